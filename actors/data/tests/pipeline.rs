//! Corpora → shards → sampler: equality of the paths, resume, and the error messages.

use nsactor_data::prepare::{PrepareOptions, prepare};
use nsactor_data::sample;
use nsactor_data::shards::{self, Dtype};
use nsactor_data::tokenizer::Message;
use nsactor_data::{Cursor, DataError, MemTokens, Mode, Sampler, ShardSet, TokenSource, Tokenizer};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn bundled_text(paragraphs: usize) -> String {
    let c = nsactor_data::bundled_corpus();
    nsactor_data::corpus::paragraphs(&c)
        .take(paragraphs)
        .collect::<Vec<_>>()
        .join("\n\n")
}

fn write(path: &Path, bytes: &[u8]) -> PathBuf {
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

fn xz(bytes: &[u8]) -> Vec<u8> {
    let mut e = liblzma::write::XzEncoder::new(Vec::new(), 6);
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

/// Three small corpora in three formats: text.xz, jsonl.gz, json.
fn corpus_files(dir: &Path) -> Vec<PathBuf> {
    let text = bundled_text(120);
    let jsonl: String = nsactor_data::corpus::paragraphs(&bundled_text(200))
        .skip(120)
        .map(|p| serde_json::json!({ "id": 1, "text": p }).to_string() + "\n")
        .collect();
    let json =
        serde_json::json!([{ "text": "A short one." }, { "text": "  " }, { "text": "Last." }]);
    vec![
        write(&dir.join("a.txt.xz"), &xz(text.as_bytes())),
        write(&dir.join("b.jsonl.gz"), &gz(jsonl.as_bytes())),
        write(&dir.join("c.json"), json.to_string().as_bytes()),
    ]
}

fn all_batches(s: &mut Sampler, n: usize, batch: usize) -> Vec<nsactor_plugin_api::Batch> {
    let seq = s.seq_len();
    (0..n).map(|_| s.next_batch(batch, seq).unwrap()).collect()
}

#[test]
fn shards_hold_exactly_the_in_memory_stream() {
    let dir = tempfile::tempdir().unwrap();
    let files = corpus_files(dir.path());
    let tok = Tokenizer::bundled();
    let mem = shards::tokenize_files(&tok, &files, "text").unwrap();
    assert_eq!(mem.documents(), 120 + 80 + 2);
    for dtype in [Dtype::U16, Dtype::U32] {
        let out = dir.path().join(format!("{dtype:?}"));
        let opts = PrepareOptions {
            shard_tokens: 5_000,
            dtype: Some(dtype),
            ..Default::default()
        };
        let r = prepare(&tok, &files, &out, &opts).unwrap();
        let m = &r.manifest;
        assert!(m.shards.len() >= 3, "{} shards", m.shards.len());
        assert_eq!(
            (m.tokens, m.documents),
            (mem.total_tokens(), mem.documents())
        );
        assert_eq!(m.tokenizer_sha256, tok.hash());
        let size = std::fs::metadata(out.join(&m.shards[0].file))
            .unwrap()
            .len();
        assert_eq!(size, m.shards[0].tokens * dtype.width() as u64);
        let set = ShardSet::open(&out, &tok, true).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        set.read(0..set.total_tokens(), &mut a);
        mem.read(0..mem.total_tokens(), &mut b);
        assert_eq!(a, b);
        for d in 0..mem.documents() {
            assert_eq!(set.document(d), mem.document(d));
        }
        // A read across a shard boundary.
        let edge = m.shards[0].tokens;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        set.read(edge - 3..edge + 3, &mut a);
        mem.read(edge - 3..edge + 3, &mut b);
        assert_eq!(a, b);
        // Documents are BOS … EOS.
        let r = set.document(5);
        let mut d = Vec::new();
        set.read(r, &mut d);
        assert_eq!((d[0], *d.last().unwrap()), (3, 4));
    }
}

#[test]
fn resuming_from_a_saved_cursor_continues_exactly() {
    let tok = Tokenizer::bundled();
    let mut mem = MemTokens::default();
    shards::tokenize_text(
        &tok,
        Path::new("x.txt"),
        &bundled_text(40),
        "text",
        &mut mem,
    )
    .unwrap();
    let mem: Arc<dyn TokenSource> = Arc::new(mem);
    let conv = vec![
        Message::new("user", "Who wrote Emma?"),
        Message::new("assistant", "Jane Austen."),
    ];
    let rows: Vec<_> = (0..7)
        .map(|i| {
            let mut c = conv.clone();
            c[0].content.push_str(&" again".repeat(i));
            sample::sft_row(&tok, &c, 33).unwrap()
        })
        .collect();
    type Make = Box<dyn Fn() -> Sampler>;
    let makers: Vec<(&str, Make)> = vec![
        ("packed", {
            let m = mem.clone();
            Box::new(move || Sampler::pretrain(m.clone(), Mode::Packed, 32, 9).unwrap())
        }),
        ("padded", {
            let m = mem.clone();
            Box::new(move || Sampler::pretrain(m.clone(), Mode::Padded, 32, 9).unwrap())
        }),
        ("sft", {
            let rows = rows.clone();
            Box::new(move || {
                let src = nsactor_data::sampler::MemRows::new(rows.clone(), 33);
                Sampler::new(Box::new(src), 9).unwrap()
            })
        }),
    ];
    for (name, make) in makers {
        let mut s = make();
        let per_epoch = s.rows_per_epoch() as usize;
        // Enough batches of 3 to cross at least two epoch boundaries.
        let n = (2 * per_epoch).div_ceil(3) + 2;
        let straight = all_batches(&mut s, n, 3);
        for k in [1, n / 2, n - 1] {
            let mut first = make();
            let mut got = all_batches(&mut first, k, 3);
            let saved = serde_json::to_string(&first.cursor()).unwrap();
            drop(first);
            let cursor: Cursor = serde_json::from_str(&saved).unwrap();
            let mut second = make();
            second.resume(cursor).unwrap();
            got.extend(all_batches(&mut second, n - k, 3));
            assert_eq!(got, straight, "{name}: resume after {k} batches");
        }
        assert!(s.cursor().epoch >= 2, "{name}: {:?}", s.cursor());
        // Another epoch has another order.
        let other = {
            let mut s = make();
            s.resume(Cursor {
                epoch: 7,
                position: 0,
            })
            .unwrap();
            all_batches(&mut s, 1, 3)
        };
        assert_ne!(other[0], straight[0], "{name}");
        let mut s = make();
        let e = s
            .resume(Cursor {
                epoch: 0,
                position: per_epoch as u64,
            })
            .unwrap_err();
        assert!(e.to_string().contains("past the"), "{e}");
    }
}

#[test]
fn packed_batches_have_no_padding_and_padded_batches_follow_the_reference() {
    let tok = Tokenizer::bundled();
    let mut mem = MemTokens::default();
    shards::tokenize_text(
        &tok,
        Path::new("x.txt"),
        &bundled_text(60),
        "text",
        &mut mem,
    )
    .unwrap();
    let mem: Arc<dyn TokenSource> = Arc::new(mem);
    let mut s = Sampler::pretrain(mem.clone(), Mode::Packed, 64, 1).unwrap();
    let b = s.next_batch(4, 64).unwrap();
    b.validate().unwrap();
    assert!(b.loss_mask.iter().all(|&m| m == 1.0));
    assert_eq!(
        &b.inputs[1..64],
        &b.targets[..63],
        "targets are inputs shifted"
    );
    let mut s = Sampler::pretrain(mem, Mode::Padded, 64, 1).unwrap();
    let b = s.next_batch(8, 64).unwrap();
    for r in 0..8 {
        let (inp, tgt, mask) = (
            &b.inputs[r * 64..(r + 1) * 64],
            &b.targets[r * 64..(r + 1) * 64],
            &b.loss_mask[r * 64..(r + 1) * 64],
        );
        assert_eq!(inp[0], 3, "rows start with BOS");
        assert!(!tgt.contains(&4), "the reference appends no EOS");
        for t in 0..64 {
            assert_eq!(mask[t] == 1.0, tgt[t] != 0, "mask = target is not padding");
        }
    }
    assert!(b.loss_mask.contains(&0.0), "short paragraphs are padded");
}

#[test]
fn sft_files_in_three_layouts_give_the_same_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let alpaca = write(
        &dir.path().join("a.json"),
        br#"[{"instruction":"Add","input":"2 and 3","output":"5"},{"instruction":"Hi","input":"","output":"Hello"}]"#,
    );
    let share = write(
        &dir.path().join("s.jsonl"),
        concat!(
            r#"{"conversations":[{"from":"human","value":"Add\n2 and 3"},{"from":"gpt","value":"5"}]}"#,
            "\n",
            r#"{"conversations":[{"from":"human","value":"Hi"},{"from":"gpt","value":"Hello"}]}"#,
            "\n"
        )
        .as_bytes(),
    );
    let msgs = write(
        &dir.path().join("m.jsonl.gz"),
        &gz(concat!(
            r#"{"messages":[{"role":"user","content":"Add\n2 and 3"},{"role":"assistant","content":"5"}]}"#,
            "\n",
            r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}]}"#,
        )
        .as_bytes()),
    );
    let want = vec![
        vec![
            Message::new("user", "Add\n2 and 3"),
            Message::new("assistant", "5"),
        ],
        vec![
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello"),
        ],
    ];
    for f in [&alpaca, &share, &msgs] {
        assert_eq!(
            sample::read_conversations(f, None).unwrap(),
            want,
            "{}",
            f.display()
        );
    }
    let with_sys = sample::read_conversations(&alpaca, Some("You are an AI assistant")).unwrap();
    assert_eq!(
        with_sys[0][0],
        Message::new("system", "You are an AI assistant")
    );
    let tok = Tokenizer::bundled();
    let (mut s, _) = nsactor_data::sampler::sft_sampler(
        &tok,
        &[alpaca],
        None,
        (16, nsactor_data::sample::SftOverflow::Keep),
        3,
    )
    .unwrap();
    let b = s.next_batch(2, 16).unwrap();
    assert!(b.loss_mask.contains(&1.0));
    let bad = write(
        &dir.path().join("bad.jsonl"),
        br#"{"conversations":[{"from":"alien","value":"x"}]}"#,
    );
    let e = sample::read_conversations(&bad, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.jsonl: line 1: unknown speaker `alien`"),
        "{e}"
    );
}

fn err<T>(r: Result<T, DataError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_inputs_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tok = Tokenizer::bundled();
    let opts = PrepareOptions::default();

    // Missing file: named, and nothing written.
    let missing = d.join("nope.txt");
    let e = err(prepare(
        &tok,
        std::slice::from_ref(&missing),
        &d.join("o1"),
        &opts,
    ));
    assert!(e.contains("cannot read") && e.contains("nope.txt"), "{e}");
    assert!(!d.join("o1").exists());
    let e = err(Tokenizer::load(&d.join("tok.json")));
    assert!(e.contains("tok.json"), "{e}");
    let junk = write(&d.join("junk.json"), b"{\"model\": 1}");
    let e = err(Tokenizer::load(&junk));
    assert!(
        e.contains("junk.json") && e.contains("not a valid tokenizer.json"),
        "{e}"
    );

    // Empty corpus.
    let blank = write(&d.join("blank.txt"), b"\n   \n\t\n");
    let e = err(prepare(
        &tok,
        std::slice::from_ref(&blank),
        &d.join("o2"),
        &opts,
    ));
    assert!(e.contains("empty corpus") && e.contains("blank.txt"), "{e}");
    let e = err(shards::tokenize_files(&tok, &[blank], "text"));
    assert!(e.contains("empty corpus"), "{e}");

    // Invalid UTF-8, plain and compressed: file and byte offset.
    let bytes = b"good text\n\nbad \xff here";
    let plain = write(&d.join("bad.txt"), bytes);
    let e = err(prepare(&tok, &[plain], &d.join("o3"), &opts));
    assert_eq!(
        e,
        format!(
            "{}: invalid UTF-8 at byte offset 15",
            d.join("bad.txt").display()
        )
    );
    let packed = write(&d.join("bad.txt.gz"), &gz(bytes));
    let e = err(nsactor_data::corpus::read_text(&packed));
    assert!(
        e.ends_with("bad.txt.gz: invalid UTF-8 at byte offset 15 of the decompressed text"),
        "{e}"
    );
    let broken = write(&d.join("broken.txt.xz"), b"not xz at all");
    let e = err(nsactor_data::corpus::read_text(&broken));
    assert!(
        e.contains("cannot decompress") && e.contains("broken.txt.xz (xz)"),
        "{e}"
    );

    // Shards made with another tokenizer.
    let good = write(&d.join("good.txt"), bundled_text(30).as_bytes());
    prepare(&tok, std::slice::from_ref(&good), &d.join("o4"), &opts).unwrap();
    let c = nsactor_data::bundled_corpus();
    let docs: Vec<&str> = nsactor_data::corpus::paragraphs(&c).take(100).collect();
    let other = nsactor_data::tokenizer::train(docs.iter(), 300).unwrap();
    let e = err(ShardSet::open(&d.join("o4"), &other, true));
    assert!(
        e.contains("made with tokenizer") && e.contains(tok.hash()) && e.contains(other.hash()),
        "{e}"
    );

    // Corrupted and truncated shards.
    let bin = d.join("o4/shard-00000.bin");
    let mut data = std::fs::read(&bin).unwrap();
    data[10] ^= 1;
    std::fs::write(&bin, &data).unwrap();
    let e = err(ShardSet::open(&d.join("o4"), &tok, true));
    assert!(e.contains("shard-00000.bin") && e.contains("sha256"), "{e}");
    assert!(
        ShardSet::open(&d.join("o4"), &tok, false).is_ok(),
        "unverified open skips sha256"
    );
    std::fs::write(&bin, &data[..data.len() - 2]).unwrap();
    let e = err(ShardSet::open(&d.join("o4"), &tok, false));
    assert!(
        e.contains("shard-00000.bin") && e.contains("the manifest says"),
        "{e}"
    );

    // A token id outside the vocabulary is named with its byte offset, checked or not.
    let mut bad = data.clone();
    bad[20..22].copy_from_slice(&u16::MAX.to_le_bytes());
    std::fs::write(&bin, &bad).unwrap();
    for verify in [true, false] {
        let e = err(ShardSet::open(&d.join("o4"), &tok, verify));
        assert!(
            e.contains("shard-00000.bin")
                && e.contains("byte offset 20")
                && e.contains("outside the vocabulary"),
            "{e}"
        );
    }
    // So is an index entry out of order.
    std::fs::write(&bin, &data).unwrap();
    let idx = d.join("o4/shard-00000.idx");
    let mut index = std::fs::read(&idx).unwrap();
    assert!(index.len() >= 24, "three documents at least");
    index[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&idx, &index).unwrap();
    let e = err(ShardSet::open(&d.join("o4"), &tok, false));
    assert!(
        e.contains("shard-00000.idx") && e.contains("byte offset 16") && e.contains("document 2"),
        "{e}"
    );

    // A vocabulary too large for u16 shards.
    let mut json: serde_json::Value = serde_json::from_str(&tok.to_json(false).unwrap()).unwrap();
    let added = json["added_tokens"].as_array_mut().unwrap();
    for id in 2048..66_000u32 {
        added.push(
            serde_json::json!({"id": id, "content": format!("<x{id}>"), "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let big = Tokenizer::from_json(&json.to_string(), "big.json").unwrap();
    assert_eq!(big.vocab_size(), 66_000);
    assert_eq!(Dtype::for_vocab(&big), Dtype::U32);
    let u16_opts = PrepareOptions {
        dtype: Some(Dtype::U16),
        ..Default::default()
    };
    let e = err(prepare(
        &big,
        std::slice::from_ref(&good),
        &d.join("o5"),
        &u16_opts,
    ));
    assert!(
        e.contains("big.json has 66000 tokens") && e.contains("u16"),
        "{e}"
    );
    let m = prepare(&big, &[good], &d.join("o6"), &PrepareOptions::default()).unwrap();
    assert_eq!(m.manifest.dtype, Dtype::U32);

    // Too little data for one row.
    let tiny = write(&d.join("tiny.txt"), b"Hi.");
    let mem = shards::tokenize_files(&tok, &[tiny], "text").unwrap();
    let e = err(Sampler::pretrain(Arc::new(mem), Mode::Packed, 64, 0));
    assert!(e.contains("no training row"), "{e}");
}

#[test]
fn sft_conversations_that_overflow_the_window_follow_the_policy() {
    use nsactor_data::sample::{Fit, SftOverflow, sft_fitted};
    let tok = Tokenizer::bundled();
    let long_prompt: String = (0..40).map(|i| format!("word{i} ")).collect();
    let conv = vec![
        Message::new("user", &long_prompt),
        Message::new("assistant", "Yes, sure."),
    ];
    let ctx = 24;
    let eos = tok.eos_id() as i64;
    // The reference (Keep): the reply is past the window, nothing is scored.
    let (row, fit) = sft_fitted(&tok, &conv, ctx, SftOverflow::Keep).unwrap();
    let row = row.unwrap();
    assert_eq!(fit, Fit::Unscored);
    assert!(row.mask.iter().all(|&m| m == 0.0));
    assert_eq!(
        row,
        sample::sft_row(&tok, &conv, ctx).unwrap(),
        "Keep is the reference row"
    );
    // Skip: left out.
    let (row, fit) = sft_fitted(&tok, &conv, ctx, SftOverflow::Skip).unwrap();
    assert_eq!((row, fit), (None, Fit::Skipped));
    // TruncateLeft: the row ends with the reply's <|im_end|>, which is scored with the reply,
    // and nothing of the prompt is.
    let (row, fit) = sft_fitted(&tok, &conv, ctx, SftOverflow::TruncateLeft).unwrap();
    let row = row.unwrap();
    assert_eq!(fit, Fit::TruncatedLeft);
    assert_eq!(row.ids.len(), ctx);
    assert_eq!(*row.ids.last().unwrap(), eos);
    let reply: Vec<i64> = tok
        .encode("Yes, sure.")
        .unwrap()
        .into_iter()
        .map(i64::from)
        .collect();
    let scored: Vec<i64> = row
        .ids
        .iter()
        .zip(&row.mask)
        .filter(|(_, m)| **m > 0.0)
        .map(|(&t, _)| t)
        .collect();
    assert_eq!(scored, [reply.as_slice(), &[eos]].concat());
    // A reply longer than the window is left out even when truncating.
    let essay: String = (0..60).map(|i| format!("reply{i} ")).collect();
    let long = vec![
        Message::new("user", "Hi"),
        Message::new("assistant", &essay),
    ];
    let (row, fit) = sft_fitted(&tok, &long, ctx, SftOverflow::TruncateLeft).unwrap();
    assert_eq!((row, fit), (None, Fit::Skipped));
    // A conversation that fits is the reference row under every policy.
    let short = vec![
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello"),
    ];
    for p in [
        SftOverflow::Keep,
        SftOverflow::TruncateLeft,
        SftOverflow::Skip,
    ] {
        let (row, fit) = sft_fitted(&tok, &short, ctx, p).unwrap();
        assert_eq!(fit, Fit::Scored);
        assert_eq!(row.unwrap(), sample::sft_row(&tok, &short, ctx).unwrap());
    }
}

#[test]
fn the_sft_report_counts_what_did_not_fit() {
    use nsactor_data::sample::{SftOverflow, sft_rows};
    let dir = tempfile::tempdir().unwrap();
    let long_prompt: String = (0..40).map(|i| format!("word{i} ")).collect();
    let text = format!(
        "[{{\"instruction\":\"{long_prompt}\",\"input\":\"\",\"output\":\"Yes.\"}},\
          {{\"instruction\":\"Hi\",\"input\":\"\",\"output\":\"Hello\"}}]"
    );
    let path = write(&dir.path().join("a.json"), text.as_bytes());
    let tok = Tokenizer::bundled();
    let (rows, report) = sft_rows(
        &tok,
        std::slice::from_ref(&path),
        None,
        25,
        SftOverflow::TruncateLeft,
    )
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.mask.contains(&1.0)));
    assert_eq!(
        (report.conversations, report.unscored, report.truncated_left),
        (2, 1, 1)
    );
    assert_eq!(
        report.to_string(),
        "1 of 2 conversations have no scored token at T = 24: 1 kept by truncating their \
         prompt from the left, 0 skipped, 0 kept unscored"
    );
    let (rows, report) = sft_rows(
        &tok,
        std::slice::from_ref(&path),
        None,
        25,
        SftOverflow::Skip,
    )
    .unwrap();
    assert_eq!((rows.len(), report.skipped), (1, 1));
    // Nothing scored at all is an error, not a run of zero losses.
    let e = sft_rows(&tok, &[path], None, 6, SftOverflow::Keep).unwrap_err();
    assert!(
        e.to_string().contains("none with a scored token at T = 5"),
        "{e}"
    );
}
