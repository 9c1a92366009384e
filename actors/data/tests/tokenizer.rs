//! Tokenizer parity with the reference, training, hashing, ChatML and SFT masks.

use nsactor_data::sample::{self, Row};
use nsactor_data::tokenizer::{self, Message, SPECIALS};
use nsactor_data::{Tokenizer, chat_template};
use std::path::PathBuf;

fn shared(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel)
}

fn reference() -> Tokenizer {
    Tokenizer::load(&shared("reference/tokenizer.json"))
        .expect("../shared/reference/tokenizer.json")
}

#[test]
fn reference_tokenizer_reproduces_the_fixture_cases() {
    let tok = reference();
    assert_eq!(tok.vocab_size(), 6144);
    for (id, s) in SPECIALS.iter().enumerate() {
        assert_eq!(tok.token_to_id(s), Some(id as u32), "{s}");
    }
    assert_eq!((tok.bos_id(), tok.eos_id()), (3, 4));
    let text = std::fs::read_to_string(shared("fixtures/tokenizer_cases.json")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text).unwrap(), want, "ids of {text:?}");
        assert_eq!(tok.encode_unoptimised(text).unwrap(), want, "{text:?}");
        let decoded = tok.decode(&want, false).unwrap();
        assert_eq!(decoded, c["decoded"].as_str().unwrap(), "decoded {text:?}");
    }
}

/// Random strings over the characters where the GPT-2 split has edge cases.
fn tricky_strings(n: usize) -> Vec<String> {
    let parts = [
        " ",
        "  ",
        "\n",
        "\t",
        "\r\n",
        "a",
        "Zq",
        "s",
        "t",
        "'",
        "'s",
        "'ll",
        "re",
        "1",
        "42",
        "!",
        ".",
        "?!",
        "-",
        "_",
        "~",
        "é",
        "ﬁ",
        "’",
        "—",
        "\u{a0}",
        "\u{301}",
        "Ａ",
        "日本",
        "😀",
        "\u{2028}",
        "<|im_end|>",
        "<|im_start|>",
        "<s>",
        "</s>",
        "<unk>",
        "<|im_",
        "<",
        "|",
        ">",
        "s>",
    ];
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .map(|_| {
            let len = (next() % 12) as usize;
            (0..len)
                .map(|_| parts[(next() % parts.len() as u64) as usize])
                .collect()
        })
        .collect()
}

#[test]
fn the_ascii_fast_path_gives_the_full_pipelines_ids() {
    let corpus = nsactor_data::bundled_corpus();
    let mut texts: Vec<String> = nsactor_data::corpus::paragraphs(&corpus)
        .map(str::to_owned)
        .collect();
    texts.extend(tricky_strings(3000));
    texts.extend(
        [
            "  leading spaces and trailing  ",
            "tabs\tand\r\nCRLF",
            "<|im_start|>user\nhi<|im_end|>\n",
            "ﬁve ﬁ ligatures (NFKC folds them) and ①",
            "",
            "control \u{1} and \u{b} and \u{7f}",
            "<|im_start|><|im_end|><s></s><unk>",
            "<|im_<|im_end|>|im_end|>",
            " <|im_start|> spaced <|im_end|> ",
            "’<|im_end|>’ and ﬁ<s>ﬁ",
        ]
        .map(str::to_owned),
    );
    // Chat prompts as the server builds them (the ChatML template's specials between texts).
    for (i, t) in tricky_strings(200).into_iter().enumerate() {
        let msgs = [
            Message::new("system", "You are a helpful assistant who answers briefly."),
            Message::new("user", &t),
            Message::new("assistant", &format!("Answer {i}: {t}")),
        ];
        texts.push(chat_template(&msgs, i % 2 == 0));
    }
    for tok in [reference(), Tokenizer::bundled()] {
        assert!(tok.has_fast_path());
        for t in &texts {
            assert_eq!(
                tok.encode(t).unwrap(),
                tok.encode_unoptimised(t).unwrap(),
                "{t:?}"
            );
        }
    }
    // NFKC really applies on the non-ASCII path.
    let tok = reference();
    assert_eq!(tok.encode("ﬁ").unwrap(), tok.encode("fi").unwrap());
}

#[test]
fn the_hash_names_the_content_not_the_file_layout() {
    let a = reference();
    let compact = a.to_json(false).unwrap();
    let b = Tokenizer::from_json(&compact, "compact copy").unwrap();
    assert_eq!(a.hash(), b.hash());
    assert_eq!(a.hash().len(), 64);
    assert_ne!(a.hash(), Tokenizer::bundled().hash());
}

#[test]
fn training_is_deterministic_with_specials_first_and_round_trips() {
    let corpus = nsactor_data::bundled_corpus();
    let docs: Vec<&str> = nsactor_data::corpus::paragraphs(&corpus)
        .take(600)
        .collect();
    let a = tokenizer::train(docs.iter(), 400).unwrap();
    let b = tokenizer::train(docs.iter(), 400).unwrap();
    assert_eq!(a.hash(), b.hash());
    assert_eq!(a.vocab_size(), 400);
    for (id, s) in SPECIALS.iter().enumerate() {
        assert_eq!(a.token_to_id(s), Some(id as u32));
    }
    let text = "It was a truth universally acknowledged, said Mr. Knightley.";
    let ids = a.encode(text).unwrap();
    assert!(
        ids.len() < text.len(),
        "merges shorten the text: {}",
        ids.len()
    );
    assert!(ids.iter().all(|&i| i >= 5 && (i as usize) < 400));
    assert_eq!(a.decode(&ids, false).unwrap(), text);
    // Bytes never seen in training still encode: the whole byte alphabet is in the vocab.
    let rare = "§ 中 🦀";
    assert_eq!(a.decode(&a.encode(rare).unwrap(), false).unwrap(), rare);
    let e = tokenizer::train(docs.iter(), 100).unwrap_err();
    assert!(e.to_string().contains("--vocab-size 100"), "{e}");
}

#[test]
fn the_bundled_tokenizer_is_ours_and_fits_the_tiny_model() {
    let t = Tokenizer::bundled();
    assert_eq!(t.vocab_size(), 2048);
    assert_eq!((t.bos_id(), t.eos_id()), (3, 4));
    let text = "Emma Woodhouse, handsome, clever, and rich";
    let ids = t.encode(text).unwrap();
    assert!(ids.len() * 3 < text.len(), "{} ids", ids.len());
}

#[test]
fn chatml_template_is_the_references() {
    let m = [Message::new("system", "S"), Message::new("user", "Hi")];
    assert_eq!(
        chat_template(&m, false),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
    assert_eq!(
        chat_template(&m[1..], true),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = reference().encode(&chat_template(&m, false)).unwrap();
    assert_eq!(ids[0], 3);
    assert_eq!(ids.iter().filter(|&&i| i == 4).count(), 2);
}

/// The row built piece by piece: role headers and the newline after `<|im_end|>` unmasked,
/// assistant content plus its `<|im_end|>` masked.
fn expected_row(tok: &Tokenizer, msgs: &[Message], ctx: usize) -> Row {
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    let mut put = |text: &str, m: f32| {
        for id in tok.encode(text).unwrap() {
            ids.push(i64::from(id));
            mask.push(m);
        }
    };
    for msg in msgs {
        put(&format!("<|im_start|>{}\n", msg.role), 0.0);
        let m = if msg.role == "assistant" { 1.0 } else { 0.0 };
        put(&format!("{}<|im_end|>", msg.content), m);
        put("\n", 0.0);
    }
    ids.resize(ctx.max(ids.len()), 0);
    mask.resize(ctx.max(mask.len()), 0.0);
    ids.truncate(ctx);
    mask.truncate(ctx);
    Row { ids, mask }
}

#[test]
fn sft_mask_covers_exactly_assistant_tokens_and_im_end() {
    let conv = vec![
        Message::new("system", "You are a helpful assistant."),
        Message::new("user", "What is the capital of France?"),
        Message::new("assistant", "Paris."),
        Message::new("user", "And of Italy? Answer in one word."),
        Message::new("assistant", " Rome, of course — 罗马."),
    ];
    for tok in [reference(), Tokenizer::bundled()] {
        let full: Vec<i64> = tok
            .encode(&chat_template(&conv, false))
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect();
        let want = expected_row(&tok, &conv, full.len() + 7);
        assert_eq!(
            &want.ids[..full.len()],
            &full[..],
            "piecewise = whole encoding"
        );
        let row = sample::sft_row(&tok, &conv, full.len() + 7).unwrap();
        assert_eq!(row, want);
        let masked: Vec<i64> = row
            .ids
            .iter()
            .zip(&row.mask)
            .filter(|(_, m)| **m == 1.0)
            .map(|(i, _)| *i)
            .collect();
        let answers: Vec<i64> = ["Paris.<|im_end|>", " Rome, of course — 罗马.<|im_end|>"]
            .iter()
            .flat_map(|t| tok.encode(t).unwrap())
            .map(i64::from)
            .collect();
        assert_eq!(masked, answers);

        // Truncated inside the second reply: that reply loses its mask (it has no <|im_end|>),
        // the first keeps it.
        let cut = full.len() - 4;
        let row = sample::sft_row(&tok, &conv, cut).unwrap();
        let first = expected_row(&tok, &conv[..3], cut);
        let n_first: usize = first.mask.iter().filter(|&&m| m == 1.0).count();
        assert_eq!(row.mask.iter().filter(|&&m| m == 1.0).count(), n_first);
        assert_eq!(row.ids, full[..cut]);

        let b = sample::shift(&[row]);
        b.validate().unwrap();
        assert_eq!(b.seq_len, cut - 1);
    }
}

#[test]
fn spans_give_the_same_ids_and_cover_the_text_in_order() {
    let tok = reference();
    for text in [
        "The cat sat on the mat, 42 times.",
        "我们在学校里学习了很多有趣的科学知识。",
    ] {
        let spanned = tok.encode_with_spans(text).unwrap();
        let ids: Vec<u32> = spanned.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, tok.encode(text).unwrap(), "{text}");
        let chars = text.chars().count();
        let (mut start, mut end) = (0, 0);
        for (_, span) in &spanned {
            assert!(span.start >= start && span.start <= span.end && span.end <= chars);
            start = span.start;
            end = end.max(span.end);
        }
        assert_eq!(end, chars, "{text}: the last token ends the text");
        assert_eq!(spanned[0].1.start, 0);
    }
}

#[test]
fn the_hugging_face_config_names_the_special_tokens_and_the_chatml_template() {
    let tok = reference();
    let c = tok.hf_tokenizer_config(131_072);
    assert_eq!(c["bos_token"], "<|im_start|>");
    assert_eq!(c["eos_token"], "<|im_end|>");
    assert_eq!(c["pad_token"], "<unk>");
    assert_eq!(
        (c["bos_token_id"].as_u64(), c["eos_token_id"].as_u64()),
        (Some(3), Some(4))
    );
    assert_eq!(c["pad_token_id"], 0);
    assert_eq!(c["model_max_length"], 131_072);
    assert_eq!(c["add_bos_token"], false);
    let template = c["chat_template"].as_str().unwrap();
    assert_eq!(template, nsactor_data::CHAT_TEMPLATE_JINJA);
    // The Jinja text spells the same turn layout as `chat_template`, piece by piece (Python's
    // jinja2 renders it to exactly `chat_template`'s text; no Jinja engine is linked here).
    let turn = chat_template(&[Message::new("user", "hi")], true);
    assert_eq!(
        turn,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    for piece in [
        "'<|im_start|>' + message['role'] + '\\n'",
        "'<|im_end|>' + '\\n'",
        "'<|im_start|>assistant\\n'",
    ] {
        assert!(template.contains(piece), "{piece} not in {template}");
    }
}
