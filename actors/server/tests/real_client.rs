//! The server driven by an independent OpenAI client library (the `async-openai` crate, over
//! plain HTTP on loopback), as deployments are: completions with `n` = 2 and log-probabilities,
//! streamed chat with the usage chunk, chat log-probabilities, and a wrong API key.

mod common;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, ChatCompletionStreamOptions,
    CreateChatCompletionRequestArgs,
};
use async_openai::types::completions::CreateCompletionRequestArgs;
use futures_util::StreamExt;
use nsactor_server::auth::ApiKeys;

const KEY: &str = "sk-real-client";

#[test]
fn the_async_openai_client_gets_what_it_asks_for() {
    let keys = ApiKeys::new([KEY.to_string()], false).unwrap();
    let s = common::serve_text_keyed(keys);
    let addr = s.addr;
    let client = move |key: &str| {
        Client::with_config(
            OpenAIConfig::new()
                .with_api_base(format!("http://{addr}/v1"))
                .with_api_key(key),
        )
    };
    s.pipeline.block_on(async move {
        let ok = client(KEY);
        // Completions: two choices, each with its tokens' log-probabilities.
        let req = CreateCompletionRequestArgs::default()
            .model("tiny_a")
            .prompt("Once upon a time")
            .max_tokens(6u32)
            .n(2u8)
            .logprobs(2u8)
            .seed(7)
            .build()
            .unwrap();
        let r = ok.completions().create(req).await.unwrap();
        assert_eq!(r.choices.len(), 2);
        let mut tokens = 0;
        for (i, c) in r.choices.iter().enumerate() {
            assert_eq!(c.index as usize, i);
            assert!(c.finish_reason.is_some(), "{c:?}");
            let lp = c.logprobs.as_ref().expect("logprobs were asked for");
            assert_eq!(lp.tokens.concat(), c.text, "{lp:?}");
            assert!(
                lp.token_logprobs
                    .iter()
                    .all(|l| l.is_some_and(|l| l <= 0.0))
            );
            tokens += lp.tokens.len();
        }
        let usage = r.usage.expect("usage");
        assert_eq!(usage.completion_tokens as usize, tokens);

        // Streamed chat with include_usage: text deltas, a finish reason, then the usage.
        let msg = ChatCompletionRequestUserMessageArgs::default()
            .content("Tell me a story.")
            .build()
            .unwrap();
        let req = CreateChatCompletionRequestArgs::default()
            .model("tiny_a")
            .messages([msg.clone().into()])
            .max_completion_tokens(5u32)
            .seed(3) // a fixed draw: an end token first would leave no text to check
            .stream(true)
            .stream_options(ChatCompletionStreamOptions {
                include_usage: Some(true),
                include_obfuscation: None,
            })
            .build()
            .unwrap();
        let mut stream = ok.chat().create_stream(req).await.unwrap();
        let (mut text, mut finished, mut usage) = (String::new(), false, None);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.unwrap();
            for c in &chunk.choices {
                text.push_str(c.delta.content.as_deref().unwrap_or(""));
                finished |= c.finish_reason.is_some();
            }
            if let Some(u) = chunk.usage {
                assert!(chunk.choices.is_empty());
                usage = Some(u);
            }
        }
        let usage = usage.expect("the usage chunk");
        assert!(finished);
        assert!(
            usage.completion_tokens >= 1 && usage.prompt_tokens > 3,
            "{usage:?}"
        );
        assert!(!text.is_empty() || usage.completion_tokens == 1);

        // Chat log-probabilities: one entry per generated token, with alternatives.
        let req = CreateChatCompletionRequestArgs::default()
            .model("tiny_a")
            .messages([msg.into()])
            .max_completion_tokens(4u32)
            .logprobs(true)
            .top_logprobs(2u8)
            .build()
            .unwrap();
        let r = ok.chat().create(req).await.unwrap();
        let content = r.choices[0]
            .logprobs
            .as_ref()
            .unwrap()
            .content
            .clone()
            .unwrap();
        assert_eq!(content.len() as u32, r.usage.unwrap().completion_tokens);
        assert!(content.iter().all(|e| e.top_logprobs.len() == 2));

        // A wrong key: the OpenAI error, as the library reads it.
        let req = CreateCompletionRequestArgs::default()
            .model("tiny_a")
            .prompt("x")
            .build()
            .unwrap();
        match client("sk-wrong").completions().create(req).await {
            Err(OpenAIError::ApiError(e)) => {
                assert_eq!(e.status_code.as_u16(), 401);
                assert_eq!(e.api_error.code.as_deref(), Some("invalid_api_key"), "{e}");
            }
            other => panic!("expected a 401, got {other:?}"),
        }
    });
}
