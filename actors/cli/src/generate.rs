//! `nsactor generate`: streaming generation to stdout, or an interactive chat loop.

use crate::args::ModelArgs;
use nsactor_launch::launch::{self};
use std::sync::Arc;

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (ignored with --chat).
    prompt: Option<String>,
    /// Interactive chat: each line you type is a user turn (ChatML).
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value_t = 50)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Only tokens at least this fraction as likely as the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.1)]
    repetition_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
}

pub fn run(a: GenerateArgs) -> crate::result::CliResult {
    use nsactor_server::generate::GenEvent;
    use nsactor_server::protocol::{ChatMessage, PromptSpec, SamplingOptions};
    use std::io::{BufRead, Write};
    let l = launch::load_checkpoint(&a.model.options()?)?;
    let state = nsactor_server::ServerState::new(
        (
            l.pipeline.decoder(l.vocab),
            l.tokenizer.clone(),
            Default::default(),
        ),
        (1, 0),
        l.name.clone(),
        Default::default(),
        Default::default(),
    );
    let options = || SamplingOptions {
        max_tokens: Some(a.max_tokens),
        temperature: Some(a.temperature),
        top_k: Some(a.top_k),
        top_p: Some(a.top_p),
        min_p: Some(a.min_p),
        repetition_penalty: Some(a.repetition_penalty),
        seed: a.seed,
        ..SamplingOptions::default()
    };
    // Streams one answer to stdout; returns its text.
    let run = |prompt: PromptSpec| -> crate::result::CliResult<String> {
        // A sampling value or prompt out of range is refused input (exit 78).
        let spec = options()
            .validate(prompt, false, &state.limits)
            .map_err(|e| crate::result::refuse(e.to_string()))?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let g = state.clone();
        l.pipeline.block_on(async move {
            let job = tokio::spawn(async move {
                g.generator
                    .run(
                        spec,
                        tx,
                        Arc::new(std::sync::atomic::AtomicBool::new(false)),
                    )
                    .await
            });
            let mut text = String::new();
            let mut out = std::io::stdout();
            while let Some(e) = rx.recv().await {
                if let GenEvent::Delta { text: t, .. } = e {
                    print!("{t}");
                    let _ = out.flush();
                    text.push_str(&t);
                }
            }
            println!();
            let f = job.await.map_err(|e| e.to_string())??;
            tracing::info!(
                "{} tokens, {:.0} ms to the first, {:.1} tokens/s ({})",
                f.usage.completion_tokens,
                f.timing.time_to_first_token_ms,
                f.timing.tokens_per_s,
                f.finish_reason
            );
            Ok(text)
        })
    };
    if !a.chat {
        let prompt = a.prompt.clone().ok_or("give a prompt, or --chat")?;
        run(PromptSpec::Text(prompt))?;
        return Ok(());
    }
    let mut messages: Vec<ChatMessage> = Vec::new();
    let stdin = std::io::stdin();
    eprint!("> ");
    let mut input = stdin.lock();
    let mut raw = Vec::new();
    loop {
        raw.clear();
        if input.read_until(b'\n', &mut raw)? == 0 {
            break;
        }
        // A line that is not UTF-8 (a terminal in another encoding, a pasted binary) is
        // refused on its own; the conversation goes on.
        let Ok(line) = std::str::from_utf8(&raw) else {
            eprintln!("that line is not UTF-8 text; type it again");
            eprint!("> ");
            continue;
        };
        let line = line.trim_end_matches(['\n', '\r']).to_string();
        if line.trim().is_empty() {
            eprint!("> ");
            continue;
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: line,
        });
        let answer = run(PromptSpec::Chat(messages.clone()))?;
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: answer,
        });
        eprint!("> ");
    }
    Ok(())
}
