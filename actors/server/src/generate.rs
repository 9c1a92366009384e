//! One generation: admission (a cap on concurrent sessions, a bounded queue, "busy" past it),
//! prefill, then one token at a time through the layer actors (a decoding stream: the batcher
//! feeds each chosen token back itself), turned here into text deltas that never split a UTF-8
//! character and never show a stop string. The session's neuron states are freed however the
//! generation ends: finished, cancelled, or its client gone.

use crate::drain::{Drain, FINISH_SHUTDOWN};
use crate::error::ServeError;
use crate::logprobs::{TokenLogprob, token_logprob};
use crate::protocol::{Finished, GenSpec, GenTiming, PromptSpec, StopReason, Usage};
use nsactor_data::Tokenizer;
use nsactor_decoding::prefix::PrefixCache;
use nsactor_decoding::{AsyncDecoder, DecodeStream, PickRequest, StreamPlan};
use nsactor_plugin_api::SessionId;
use nsactor_telemetry::ServingMetrics;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::sync::mpsc;

mod admission;
mod stops;
pub use admission::Admission;
use admission::gone;
use stops::{first_stop, held_back};

/// Token ids 0–4: `<unk> <s> </s> <|im_start|> <|im_end|>` (SPEC §9).
const END_TOKENS: [i64; 2] = [2, 4];
const NEVER_GENERATED: [i64; 3] = [0, 1, 3];

/// What the generator reports while it runs.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// The prompt's tokens and their log-probabilities (the first has none), when asked for.
    Prompt {
        ids: Vec<i64>,
        logprobs: Vec<Option<TokenLogprob>>,
    },
    /// New text, the tokens that made it and (when asked for) their log-probabilities.
    Delta {
        text: String,
        token_ids: Vec<i64>,
        logprobs: Vec<TokenLogprob>,
    },
    Done(Finished),
}

/// The finish reason of a generation that ran out of its time budget.
pub const FINISH_TIME_LIMIT: &str = "time_limit";

/// Tokens chosen but not yet sent, with their log-probabilities when asked for.
#[derive(Default)]
struct Pending {
    ids: Vec<i64>,
    logprobs: Vec<TokenLogprob>,
}

/// The model side of the server.
pub struct Generator {
    pub decoder: AsyncDecoder,
    /// Snapshots of sessions' states by the tokens they saw ([`PrefixCache`]).
    pub prefix: Arc<PrefixCache>,
    pub tokenizer: Arc<Tokenizer>,
    pub admission: Admission,
    pub metrics: Arc<ServingMetrics>,
    pub max_prompt_tokens: usize,
    /// Shutdown: refuses new generations and ends running ones ([`Drain`]).
    pub drain: Arc<Drain>,
    /// Refuses generations until the warm-up is done ([`Readiness`](crate::ready::Readiness)).
    pub ready: Arc<crate::ready::Readiness>,
}

impl Generator {
    /// Whether a text prompt's own first token is the BOS (a ChatML text, or text a client
    /// detokenized with it): then no second BOS is put in front of it.
    fn starts_with_bos(&self, text_ids: &[i64]) -> bool {
        text_ids.first() == Some(&i64::from(self.tokenizer.bos_id()))
    }

    /// How many tokens the server puts in front of text prompt `t` (the BOS where `bos` and
    /// the text does not begin with one): context the model reads but the client did not send.
    pub fn leading_tokens(&self, t: &str, bos: bool) -> usize {
        let first = self
            .tokenizer
            .encode(t)
            .ok()
            .and_then(|ids| ids.first().copied());
        usize::from(bos && first != Some(self.tokenizer.bos_id()))
    }

    /// Token ids of `p` as the model would read them, unchecked: `bos` starts a text prompt
    /// with the beginning-of-text token (unless its text begins with one), `generation_prompt` ends chat messages with the
    /// assistant's turn opening (generation does both; `/tokenize` lets the client choose).
    pub fn token_ids(
        &self,
        p: &PromptSpec,
        bos: bool,
        generation_prompt: bool,
    ) -> Result<Vec<i64>, ServeError> {
        let encode = |text: &str| -> Result<Vec<i64>, ServeError> {
            let ids = self
                .tokenizer
                .encode(text)
                .map_err(|e| ServeError::Invalid(e.to_string()))?;
            Ok(ids.into_iter().map(i64::from).collect())
        };
        Ok(match p {
            PromptSpec::Ids(ids) => ids.clone(),
            PromptSpec::Text(t) => {
                let text = encode(t)?;
                let mut ids = Vec::with_capacity(text.len() + 1);
                if bos && !self.starts_with_bos(&text) {
                    ids.push(i64::from(self.tokenizer.bos_id()));
                }
                ids.extend(text);
                ids
            }
            PromptSpec::Chat(m) => {
                let msgs: Vec<nsactor_data::Message> = m
                    .iter()
                    .map(|m| nsactor_data::Message::new(&m.role, &m.content))
                    .collect();
                encode(&nsactor_data::chat_template(&msgs, generation_prompt))?
            }
        })
    }

    /// Token ids of the request's prompt (a text one after the BOS where `bos`), checked
    /// against the length limit and vocabulary.
    /// What is wrong with the first of `ids` outside the vocabulary, if one is.
    pub fn outside_vocab(&self, ids: &[i64]) -> Option<String> {
        let vocab = self.decoder.vocab() as i64;
        let bad = ids.iter().find(|&&t| t < 0 || t >= vocab)?;
        Some(format!(
            "token id {bad} is outside the vocabulary (0..{vocab})"
        ))
    }

    pub fn prompt_ids(&self, spec: &GenSpec) -> Result<Vec<i64>, ServeError> {
        let p = &spec.prompt;
        let mut ids = self.token_ids(p, spec.add_special_tokens, true)?;
        if let Some(k) = spec.extras.truncate_prompt_tokens {
            ids.drain(..ids.len().saturating_sub(k));
        }
        let field = match p {
            PromptSpec::Chat(_) => "messages",
            _ => "prompt",
        };
        if ids.len() > self.max_prompt_tokens {
            return Err(ServeError::field(
                field,
                format!(
                    "the prompt has {} tokens; the limit is {} (`nsactor serve --max-prompt-tokens`)",
                    ids.len(),
                    self.max_prompt_tokens
                ),
            ));
        }
        if let Some(why) = self.outside_vocab(&ids) {
            return Err(ServeError::field(field, why));
        }
        Ok(ids)
    }

    /// Runs `spec`, sending deltas to `tx`; stops when `cancel` is set or `tx` is closed (the
    /// client went away), within one token.
    pub async fn run(
        &self,
        spec: GenSpec,
        tx: mpsc::Sender<GenEvent>,
        cancel: Arc<AtomicBool>,
    ) -> Result<Finished, ServeError> {
        let start = Instant::now();
        self.ready.check()?;
        let _running = self.drain.enter()?;
        let prompt = self.prompt_ids(&spec)?;
        let vocab = self.decoder.vocab();
        if let Some((id, _)) = spec.logit_bias.iter().find(|(id, _)| *id >= vocab) {
            return Err(ServeError::field(
                "logit_bias",
                format!("token id {id} is outside the vocabulary (0..{vocab})"),
            ));
        }
        let x = &spec.extras;
        for (field, ids) in [
            ("stop_token_ids", &x.stop_token_ids[..]),
            (
                "allowed_token_ids",
                x.allowed_token_ids.as_deref().unwrap_or(&[]),
            ),
        ] {
            if let Some(why) = self.outside_vocab(ids) {
                return Err(ServeError::field(field, why));
            }
        }
        // A client gone while its request waits for a place leaves the queue at once.
        let permit = tokio::select! {
            p = self.admission.enter() => p?,
            _ = gone(&tx, &cancel) => {
                let f = given_up(prompt.len(), start);
                self.finished(&f);
                return Ok(f);
            }
        };
        let session = self.decoder.session();
        self.metrics.running.inc();
        // A client gone while its prompt is fed (a long prompt, a slow pass): the chunks not
        // yet fed are given up, not run for nobody. Streaming, the token loop sees it itself.
        let decoding = self.decode(session, &prompt, &spec, &tx, &cancel, start);
        tokio::pin!(decoding);
        let mut abandoned = false;
        let r = tokio::select! {
            r = &mut decoding => r,
            _ = gone(&tx, &cancel) => {
                self.decoder.give_up(session);
                abandoned = true;
                decoding.await
            }
        };
        // Given up in its prompt: nothing to send, and its states (a prompt fed in part)
        // are not the prefix cache's to keep.
        let prompt_given_up = abandoned && r.is_err();
        let r = match r {
            Err(_) if prompt_given_up => Ok(given_up(prompt.len(), start)),
            r => r,
        };
        // The client has its last token: its final event goes out, and its place is free for
        // the next request, before the session's states are freed (a free is a job on every
        // stage's worker; 256 sessions ending together took about 0.3 s of them). The close
        // is queued at the batcher before the place is given back, so the request admitted in
        // it is batched after this session has left: cohorts stay within `max_sessions`. A
        // request through the prefix cache files the snapshot of its states before its final
        // event goes out, so a conversation's next turn, sent on that event, finds it.
        match &r {
            Ok(f) if self.caches(&spec) && !prompt_given_up => {
                self.prefix
                    .close(&self.decoder, session, f.tokens.clone())
                    .await;
                let _ = tx.send(GenEvent::Done(f.clone())).await;
                drop(permit);
            }
            _ => {
                if let Ok(f) = &r {
                    let _ = tx.send(GenEvent::Done(f.clone())).await;
                }
                let closed = self.decoder.begin_close(session);
                drop(permit);
                closed.await;
            }
        }
        self.metrics.running.dec();
        let r = r?;
        self.finished(&r);
        Ok(r)
    }

    /// Counts a generation that ended in the metrics.
    fn finished(&self, r: &Finished) {
        self.metrics.finished(
            r.finish_reason,
            (
                r.usage.prompt_tokens as u64,
                r.usage.completion_tokens as u64,
            ),
            (
                r.timing.time_to_first_token_ms / 1e3,
                r.timing.total_ms / 1e3,
            ),
        );
    }

    /// Whether `spec`'s prompt is fed through the prefix cache and its states kept at its
    /// end: asked for (by default), the cache on, and not scoring the prompt (which goes
    /// through the cache in its own way, [`PrefixCache::score`]).
    fn caches(&self, spec: &GenSpec) -> bool {
        spec.cache_prompt && spec.prompt_logprobs.is_none() && self.prefix.enabled()
    }

    /// Scores the prompt: every token's log-probability given the ones before it
    /// ([`GenEvent::Prompt`]), from one prefill of all but its last token (every position's
    /// logits, a pass at a time; through the prefix cache unless the request opts out: a
    /// prefix scored before is not fed again); then, unless nothing is to be generated
    /// (`plan` is `None`: `max_tokens` 0, lm-evaluation-harness's scoring), streams from its
    /// last token as `plan` says. The numbers equal those of feeding the prompt one token at
    /// a time.
    async fn score_prompt(
        &self,
        session: SessionId,
        (prompt, spec): (&[i64], &GenSpec),
        top: usize,
        tx: &mpsc::Sender<GenEvent>,
        plan: Option<StreamPlan>,
    ) -> Result<Option<DecodeStream>, ServeError> {
        let started = Instant::now();
        let cached = (&spec.parts[..], spec.cache_prompt);
        let logprobs = self
            .prefix
            .score(&self.decoder, session, prompt, top, cached)
            .await?;
        let scored = started.elapsed();
        let last = *prompt.last().expect("prompts are never empty");
        let picked = match plan {
            Some(plan) => Some(self.decoder.stream(session, vec![last], plan).await?),
            None => None,
        };
        let ids = prompt.to_vec();
        let _ = tx.send(GenEvent::Prompt { ids, logprobs }).await;
        tracing::debug!(
            "{session}: {} prompt tokens scored in {:.2} ms",
            prompt.len(),
            scored.as_secs_f64() * 1e3,
        );
        Ok(picked)
    }

    /// How the next token is chosen on the device: the request's sampling, its logit biases
    /// and (unless `ignore_eos`) the bans on tokens never generated.
    fn pick_request(&self, spec: &GenSpec, history: &[i64], generated: &[i64]) -> PickRequest {
        // Each token once, in first-named order; `at` finds a token's entry (a ban of the
        // whole vocabulary but a few, `allowed_token_ids`, stays linear).
        let mut bias: Vec<(u32, f32)> = Vec::new();
        let mut at: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        let mut set = |t: u32, f: &dyn Fn(&mut f32), new: f32| match at.get(&t) {
            Some(&i) => f(&mut bias[i].1),
            None => {
                at.insert(t, bias.len());
                bias.push((t, new));
            }
        };
        // Ids past the vocabulary were refused before admission (`run`).
        let vocab = self.decoder.vocab();
        for &(id, b) in spec.logit_bias.iter().filter(|(id, _)| *id < vocab) {
            set(id as u32, &|x| *x += b, b);
        }
        let mut ban = |t: u32| set(t, &|x| *x = f32::NEG_INFINITY, f32::NEG_INFINITY);
        if !spec.ignore_eos {
            NEVER_GENERATED.iter().for_each(|&t| ban(t as u32));
        }
        if let Some(allowed) = &spec.extras.allowed_token_ids {
            let allowed: std::collections::HashSet<i64> = allowed.iter().copied().collect();
            (0..vocab as u32)
                .filter(|t| !allowed.contains(&i64::from(*t)))
                .for_each(ban);
        }
        // `min_tokens`: no token that would end the generation before then.
        let ends: Vec<u32> = self
            .end_tokens(spec)
            .into_iter()
            .map(|t| t as u32)
            .collect();
        PickRequest::new(
            spec.sampling,
            history,
            generated,
            bias,
            spec.logprobs.is_some(),
        )
        .banning_until(&ends, spec.extras.min_tokens as u64)
    }

    /// The tokens that end `spec`'s generation when chosen: the end tokens (unless
    /// `ignore_eos`) and `stop_token_ids`.
    fn end_tokens(&self, spec: &GenSpec) -> Vec<i64> {
        let mut ends = match spec.ignore_eos {
            true => Vec::new(),
            false => END_TOKENS.to_vec(),
        };
        ends.extend(&spec.extras.stop_token_ids);
        ends
    }

    async fn decode(
        &self,
        session: SessionId,
        prompt: &[i64],
        spec: &GenSpec,
        tx: &mpsc::Sender<GenEvent>,
        cancel: &AtomicBool,
        start: Instant,
    ) -> Result<Finished, ServeError> {
        let mut generated: Vec<i64> = Vec::new();
        let mut pending = Pending::default();
        let mut emitted = 0usize; // bytes of the decoded text already sent
        let mut first_token_at = None;
        let mut last_token_at: Option<Instant> = None;
        let top = spec.logprobs.unwrap_or(0);
        // The batcher feeds every chosen token back itself: the session is never away from
        // it between steps, however slow this task or its client. A stop string found below
        // costs the step already queued.
        let plan = StreamPlan {
            pick: self.pick_request(spec, prompt, &[]),
            more: spec.max_tokens.saturating_sub(1),
            end_tokens: self.end_tokens(spec),
        };
        // `None` when the prompt is only scored: its last token needs no pass.
        let mut stream = if let Some(prompt_top) = spec.prompt_logprobs {
            let plan = (spec.max_tokens > 0).then_some(plan);
            self.score_prompt(session, (prompt, spec), prompt_top, tx, plan)
                .await?
        } else {
            let fed = if self.caches(spec) {
                self.prefix
                    .prefill_parting(&self.decoder, session, prompt, &spec.parts)
                    .await?
            } else {
                0
            };
            Some(
                self.decoder
                    .stream(session, prompt[fed..].to_vec(), plan)
                    .await?,
            )
        };
        let streaming = start.elapsed();
        // The generation's text, grown a piece per token (a token costs the same at any
        // length; decoding the whole generation each time cost O(n) a token).
        let mut text = String::new();
        let mut pieces = self.tokenizer.text_stream(spec.extras.skip_special_tokens);
        let mut stopped_by_string = false;
        let mut stop_reason = None;
        let mut end_token = None;
        let mut end_logprob = None;
        let finish_reason = loop {
            if self.drain.stopping() {
                break FINISH_SHUTDOWN;
            }
            if cancel.load(Ordering::SeqCst) || tx.is_closed() {
                break "cancelled";
            }
            if spec.time_limit.is_some_and(|l| start.elapsed() >= l) {
                break FINISH_TIME_LIMIT;
            }
            if generated.len() >= spec.max_tokens {
                break "length"; // max_tokens = 0: the prompt was only scored
            }
            let Some(stream) = stream.as_mut() else {
                break "length";
            };
            let mut picked = match stream.next().await {
                Some(p) => p?,
                None if self.drain.stopping() => break FINISH_SHUTDOWN,
                None => {
                    return Err(ServeError::Internal(
                        "the decoding stream ended before its last token".into(),
                    ));
                }
            };
            // Chosen on the device; log-probabilities come from the model's own distribution.
            let next = picked.token;
            let raw = picked.logits.take();
            let now = Instant::now();
            if let Some(last) = last_token_at.replace(now) {
                self.metrics
                    .inter_token_latency
                    .observe((now - last).as_secs_f64());
            }
            if first_token_at.is_none() {
                tracing::debug!(
                    "{session}: {} prompt tokens; streaming after {:.2} ms, first token after {:.2} ms",
                    prompt.len(),
                    streaming.as_secs_f64() * 1e3,
                    (now - start).as_secs_f64() * 1e3
                );
                first_token_at = Some(now);
            }
            if !spec.ignore_eos && END_TOKENS.contains(&next) {
                // Generated though not shown: usage counts it, as OpenAI and vLLM do.
                end_token = Some(next);
                end_logprob = raw.map(|raw| token_logprob(&raw, next, top));
                break "stop";
            }
            generated.push(next);
            pending.ids.push(next);
            if let Some(raw) = raw {
                pending.logprobs.push(token_logprob(&raw, next, top));
            }
            // An incomplete UTF-8 character adds nothing until its last byte comes.
            let grown = text.len();
            let piece = pieces
                .step(next as u32)
                .map_err(|e| ServeError::Internal(e.to_string()))?;
            text.push_str(piece.as_deref().unwrap_or(""));
            // A stop string ends the generation; the text before it is the answer (with it,
            // where `include_stop_str_in_output`). Before `min_tokens`, nothing stops it.
            let armed = generated.len() >= spec.extras.min_tokens;
            if let Some((pos, len)) = first_stop(&text, &spec.stop, grown).filter(|_| armed) {
                let end = match spec.extras.include_stop_str_in_output {
                    true => pos + len,
                    false => pos,
                };
                stopped_by_string = true;
                stop_reason = Some(StopReason::Text(text[pos..pos + len].to_string()));
                text.truncate(end.max(emitted));
                break "stop";
            }
            // A stop token id ends it after its text, as vLLM's does.
            if armed && spec.extras.stop_token_ids.contains(&next) {
                stop_reason = Some(StopReason::Token(next));
                break "stop";
            }
            // Hold back a possible stop-string start.
            let end = text.len() - held_back(&text, &spec.stop);
            if end > emitted && text.is_char_boundary(end) {
                self.send(tx, &text[emitted..end], &mut pending, spec.token_ids)
                    .await;
                emitted = end;
            } else if spec.token_ids {
                // A client that streams token ids gets each token as it comes; the text held
                // back (an incomplete character, a possible stop string) follows later.
                self.send(tx, "", &mut pending, true).await;
            }
        };
        // Whatever is still held back (and any tokens not yet sent) goes out now, with a
        // character left incomplete at the end as the replacement character.
        if !stopped_by_string && finish_reason != "cancelled" {
            let tail = pieces
                .finish()
                .map_err(|e| ServeError::Internal(e.to_string()))?;
            text.push_str(&tail);
        }
        if finish_reason != "cancelled" && (text.len() > emitted || !pending.ids.is_empty()) {
            let tail = text.get(emitted..).unwrap_or("");
            self.send(tx, tail, &mut pending, spec.token_ids).await;
        }
        let total = start.elapsed().as_secs_f64();
        let ttft = first_token_at.map_or(total, |t| (t - start).as_secs_f64());
        let n = generated.len();
        Ok(Finished {
            finish_reason,
            usage: Usage {
                prompt_tokens: prompt.len(),
                completion_tokens: n + usize::from(end_token.is_some()),
                total_tokens: prompt.len() + n + usize::from(end_token.is_some()),
            },
            timing: GenTiming {
                time_to_first_token_ms: ttft * 1e3,
                total_ms: total * 1e3,
                tokens_per_s: if n > 1 && total > ttft {
                    (n - 1) as f64 / (total - ttft)
                } else {
                    0.0
                },
            },
            tokens: prompt.iter().chain(&generated).copied().collect(),
            end_token,
            end_logprob,
            stop_reason,
        })
    }

    async fn send(
        &self,
        tx: &mpsc::Sender<GenEvent>,
        text: &str,
        pending: &mut Pending,
        with_ids: bool,
    ) {
        let Pending { ids, logprobs } = std::mem::take(pending);
        // Log-probabilities name their tokens: the ids go with them.
        let keep_ids = with_ids || !logprobs.is_empty();
        let _ = tx
            .send(GenEvent::Delta {
                text: text.to_string(),
                token_ids: if keep_ids { ids } else { Vec::new() },
                logprobs,
            })
            .await;
    }
}

/// A generation whose client went away before it sent anything: in the queue, or while its
/// prompt was fed.
fn given_up(prompt_tokens: usize, start: Instant) -> Finished {
    let total_ms = start.elapsed().as_secs_f64() * 1e3;
    Finished {
        finish_reason: "cancelled",
        usage: Usage {
            prompt_tokens,
            completion_tokens: 0,
            total_tokens: prompt_tokens,
        },
        timing: GenTiming {
            time_to_first_token_ms: total_ms,
            total_ms,
            tokens_per_s: 0.0,
        },
        tokens: Vec::new(),
        end_token: None,
        end_logprob: None,
        stop_reason: None,
    }
}
