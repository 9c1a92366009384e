//! The request parser against the fields clients send, the kept corpus and arbitrary bytes.

use super::*;
use proptest::prelude::*;

fn call(body: &str, chat: bool) -> Result<OpenAiCall, ServeError> {
    parse(body.as_bytes(), &Limits::default(), "tiny", chat)
}

#[test]
fn fields_clients_send_are_read_and_bad_ones_named() {
    let c = call(
        r#"{"model":"tiny","prompt":"hi","n":2,"logprobs":3,"echo":true,"max_tokens":0,
            "stream":true,"stream_options":{"include_usage":true},"user":"u","seed":-1,
            "presence_penalty":0.5,"logit_bias":{"7":-100},"best_of":2,"suffix":""}"#,
        false,
    )
    .unwrap();
    assert_eq!(
        (c.n, c.stream, c.include_usage, c.echo),
        (2, true, true, true)
    );
    assert_eq!(c.specs[0].logprobs, Some(3));
    assert!(c.specs[0].prompt_logprobs == Some(3) && c.specs[0].max_tokens == 0);
    assert_eq!(c.specs[0].logit_bias, [(7, -100.0)]);
    assert_eq!(c.specs[0].sampling.seed, u64::MAX);
    let chat = call(
        r#"{"messages":[{"role":"developer","content":[{"type":"text","text":"be brief"}]},
            {"role":"user","content":"hi","name":"ann"}],"logprobs":true,"top_logprobs":2,
            "max_completion_tokens":5,"response_format":{"type":"text"},"tool_choice":"none"}"#,
        true,
    )
    .unwrap();
    assert_eq!(chat.specs[0].logprobs, Some(2));
    assert_eq!(chat.specs[0].max_tokens, 5);
    let PromptSpec::Chat(m) = &chat.specs[0].prompt else {
        panic!("chat")
    };
    assert_eq!(
        (m[0].role.as_str(), m[0].content.as_str()),
        ("system", "be brief")
    );
    // Text parts joined as vLLM joins them; `top_k` -1 is vLLM's "no limit".
    let parts = call(
        r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"},
            {"type":"text","text":"there"}]}],"top_k":-1}"#,
        true,
    )
    .unwrap();
    let PromptSpec::Chat(m) = &parts.specs[0].prompt else {
        panic!("chat")
    };
    assert_eq!(m[0].content, "hi\nthere");
    assert_eq!(parts.specs[0].sampling.top_k, 0);
    // (body, chat, the param the error names)
    let bad = [
        (r#"{"prompt":"hi","max_tokens":"5"}"#, false, "max_tokens"),
        (r#"{"prompt":"hi","frobnicate":1}"#, false, "frobnicate"),
        (r#"{"prompt":"hi","n":0}"#, false, "n"),
        (r#"{"prompt":"hi","n":99}"#, false, "n"),
        (r#"{"prompt":"hi","logprobs":true}"#, false, "logprobs"),
        (r#"{"prompt":"hi","logprobs":50}"#, false, "logprobs"),
        (r#"{"prompt":"hi","max_tokens":0}"#, false, "max_tokens"),
        (
            r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}"#,
            true,
            "max_completion_tokens",
        ),
        (r#"{"prompt":"hi","suffix":"x"}"#, false, "suffix"),
        (r#"{"prompt":"hi","top_k":-2}"#, false, "top_k"),
        (r#"{"prompt":"hi","best_of":3}"#, false, "best_of"),
        (
            r#"{"prompt":"hi","stream_options":{"include_usage":true}}"#,
            false,
            "stream_options",
        ),
        (
            r#"{"prompt":"hi","logit_bias":{"a":1}}"#,
            false,
            "logit_bias",
        ),
        (
            r#"{"prompt":"hi","logit_bias":{"1":500}}"#,
            false,
            "logit_bias",
        ),
        (
            r#"{"prompt":"hi","presence_penalty":3}"#,
            false,
            "presence_penalty",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"echo":true}"#,
            true,
            "echo",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
            true,
            "top_logprobs",
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
            true,
            "messages",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{}]}"#,
            true,
            "tools",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}"#,
            true,
            "response_format",
        ),
    ];
    for (body, chat, param) in bad {
        let e = call(body, chat).unwrap_err();
        assert_eq!(e.status(), 400, "{body}: {e}");
        assert_eq!(e.param().unwrap_or(""), param, "{body}: {e}");
    }
    // Errors in the client's words: the field named, no serde or Rust type names.
    for (body, chat, param, words) in [
        (
            r#"{"prompt":"hi","logprobs":-1}"#,
            false,
            "logprobs",
            "got -1; expected true or false",
        ),
        (
            r#"{"prompt":"hi","stop":5}"#,
            false,
            "stop",
            "expected a string or a list of strings",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"response_format":"text"}"#,
            true,
            "response_format",
            r#"got string "text", expected an object"#,
        ),
        (
            r#"{"prompt":"x","prompt":"y"}"#,
            false,
            "prompt",
            "`prompt` is given twice",
        ),
        (
            r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#,
            true,
            "top_logprobs",
            "at most 20 alternatives per token, got 21",
        ),
        (
            r#"{"messages":[{"role":"tool","content":"x","tool_call_id":"c1"}]}"#,
            true,
            "messages",
            "tool messages are not supported",
        ),
    ] {
        let e = call(body, chat).unwrap_err();
        assert_eq!(
            (e.status(), e.param()),
            (400.try_into().unwrap(), Some(param)),
            "{body}: {e}"
        );
        let m = e.to_string();
        assert!(m.contains(words), "{body}: {m}");
        for serde_words in ["untagged", "struct", "usize", "line 1"] {
            assert!(!m.contains(serde_words), "{body}: {m}");
        }
    }
    // A body that is not one JSON object: refused as such, trailing bytes too.
    for (body, code) in [
        ("[]", "invalid_request"),
        ("5", "invalid_request"),
        (
            r#"{"prompt":"hi","max_tokens":1}{"garbage":"#,
            "invalid_json",
        ),
        (r#"{"prompt":"hi"} xyz"#, "invalid_json"),
    ] {
        let e = call(body, false).unwrap_err();
        assert_eq!(e.code(), code, "{body}: {e}");
    }
    assert!(call("{\"prompt\":\"hi\"}\n ", false).is_ok());
    // `null` is "not given" for the flags too.
    let nulls = call(
        r#"{"prompt":"hi","stream":null,"echo":null,"ignore_eos":null}"#,
        false,
    )
    .unwrap();
    assert!(!nulls.stream && !nulls.echo);
    // An answer appended to the history as the OpenAI client dumps it.
    let dumped = call(
        r#"{"messages":[{"role":"user","content":"hi"},
            {"role":"assistant","content":null,"refusal":null,"annotations":[],"audio":null,
             "function_call":null,"tool_calls":null},
            {"role":"user","content":"again"}]}"#,
        true,
    )
    .unwrap();
    let PromptSpec::Chat(m) = &dumped.specs[0].prompt else {
        panic!("chat")
    };
    assert_eq!(
        (m[1].role.as_str(), m[1].content.as_str()),
        ("assistant", "")
    );
    let unknown = call(r#"{"prompt":"hi","frobnicate":1}"#, false).unwrap_err();
    assert!(unknown.to_string().contains("frobnicate"), "{unknown}");
    let wrong = call(r#"{"model":"gpt-4","prompt":"hi"}"#, false).unwrap_err();
    assert_eq!(wrong.status(), 404);
    assert_eq!(wrong.param(), Some("model"));
}

/// The kept corpus (`fuzz-corpus-openai/`): `ok-*` bodies parse, `bad-*` ones get a 4xx
/// with a message; `*-chat-*` go to the chat endpoint.
#[test]
fn the_corpus_parses_as_labelled() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/fuzz-corpus-openai");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let r = parse(
            &std::fs::read(&path).unwrap(),
            &Limits::default(),
            "tiny_a",
            name.contains("-chat-"),
        );
        if name.starts_with("ok-") {
            assert!(r.is_ok(), "{name}: {:?}", r.err());
        } else {
            let e = r.expect_err(&name);
            assert!(
                e.status().is_client_error() && !e.to_string().is_empty(),
                "{name}: {e}"
            );
        }
        n += 1;
    }
    assert!(n >= 15, "corpus went missing: {n} files");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: Some(Box::new(
        proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"))),
        ..ProptestConfig::default() })]

    /// Arbitrary bytes never panic the parser; what is refused is the client's error.
    #[test]
    fn arbitrary_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300), chat in any::<bool>()) {
        if let Err(e) = parse(&bytes, &Limits::default(), "m", chat) {
            prop_assert!(e.status().is_client_error(), "{e}");
        }
    }

    /// JSON-shaped mutations of valid bodies: accepted ones respect the limits, refused
    /// ones are 4xx with a message.
    #[test]
    fn mutated_bodies_never_panic(
        key in "(model|prompt|messages|max_tokens|max_completion_tokens|temperature|top_p|top_k|n|best_of|logprobs|top_logprobs|echo|stop|seed|logit_bias|stream|stream_options|presence_penalty|frequency_penalty|response_format|tools|tool_choice|suffix|user|x)",
        value in prop_oneof![
            Just("null".to_string()), Just("-1".to_string()), Just("1e309".to_string()),
            Just("true".to_string()), Just("\"\"".to_string()), Just("[]".to_string()),
            Just("{}".to_string()), Just("[1,-5]".to_string()), Just("{\"1\":2}".to_string()),
            Just("[{\"role\":\"user\",\"content\":[]}]".to_string()),
            "\"[^\"\\\\]{0,20}\"", "-?[0-9]{1,20}(\\.[0-9]{1,5})?",
        ],
        chat in any::<bool>(),
    ) {
        let base = if chat { r#""messages":[{"role":"user","content":"x"}]"# } else { r#""prompt":"hi""# };
        let body = format!(r#"{{{base},"{key}":{value}}}"#);
        let limits = Limits::default();
        match parse(body.as_bytes(), &limits, "m", chat) {
            Ok(c) => {
                prop_assert!(c.n >= 1 && c.n <= limits.max_n);
                prop_assert!(c.specs[0].max_tokens <= limits.max_new_tokens);
                prop_assert!(c.specs[0].logprobs.unwrap_or(0) <= limits.max_logprobs);
            }
            Err(e) => prop_assert!(e.status().is_client_error() && !e.to_string().is_empty(), "{body}: {e}"),
        }
    }
}

#[test]
fn an_echo_with_nothing_generated_needs_no_logprobs() {
    // OpenAI's legacy endpoint returns the prompt itself; it is scored (one pass), and its
    // log-probabilities are not asked for.
    let c = call(r#"{"prompt":"hi","echo":true,"max_tokens":0}"#, false).unwrap();
    assert!(c.echo && c.specs[0].prompt_logprobs == Some(0) && c.specs[0].max_tokens == 0);
    assert_eq!(c.specs[0].logprobs, None);
    // An echo that generates runs as before: no scoring pass without logprobs.
    let c = call(r#"{"prompt":"hi","echo":true,"max_tokens":2}"#, false).unwrap();
    assert_eq!(c.specs[0].prompt_logprobs, None);
    // Nothing to generate and nothing echoed is still refused, naming the field.
    let e = call(r#"{"prompt":"hi","max_tokens":0}"#, false).unwrap_err();
    assert!(e.to_string().contains("max_tokens must be in 1..="), "{e}");
}

#[test]
fn vllm_prompt_logprobs_are_read_and_bad_ones_named() {
    // Its own count of alternatives, on completions and chat; the echo's follow it, as vLLM's.
    let c = call(
        r#"{"prompt":"hi","max_tokens":0,"prompt_logprobs":2,"echo":true,"logprobs":5}"#,
        false,
    )
    .unwrap();
    assert!(c.prompt_logprobs && c.specs[0].prompt_logprobs == Some(2));
    assert_eq!(c.specs[0].logprobs, Some(5));
    let c = call(
        r#"{"messages":[{"role":"user","content":"hi"}],"prompt_logprobs":0}"#,
        true,
    )
    .unwrap();
    assert!(c.prompt_logprobs && c.specs[0].prompt_logprobs == Some(0));
    // Without it nothing changes.
    let c = call(r#"{"prompt":"hi"}"#, false).unwrap();
    assert!(!c.prompt_logprobs && c.specs[0].prompt_logprobs.is_none());
    for body in [
        r#"{"prompt":"hi","prompt_logprobs":-1}"#,
        r#"{"prompt":"hi","prompt_logprobs":21}"#,
        r#"{"prompt":"hi","prompt_logprobs":1,"stream":true}"#,
        r#"{"prompt":"hi","prompt_logprobs":"1"}"#,
    ] {
        let e = call(body, false).unwrap_err();
        assert_eq!(e.param(), Some("prompt_logprobs"), "{body}: {e}");
    }
}
