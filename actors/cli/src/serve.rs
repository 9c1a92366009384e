//! `nsactor serve`: the server over a checkpoint. It listens at once, warms the decoder up at
//! every cohort size it will run (`/health` answers 503 `warming` meanwhile), then takes
//! requests.

use crate::args::OpenArgs;
use crate::result::refuse;
use nsactor_decoding::AsyncDecoder;
use nsactor_decoding::heal::{Health, RestartPolicy};
use nsactor_decoding::warmup::WarmupPlan;
use nsactor_launch::launch;
use nsactor_server::ServerState;
use nsactor_server::ready::Readiness;
use std::time::{Duration, Instant};

/// How long generations get to end after the grace period (they stop within one token).
const STOP_WAIT: Duration = Duration::from_secs(10);

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The model to serve, as --checkpoint takes it: a run or Hugging Face directory, or a Hub
    /// name `owner/name[@revision]` (`nsactor serve Brain2nd/NeuronSpark-0.9B-Chat`).
    #[arg(value_name = "MODEL", required_unless_present = "checkpoint")]
    model: Option<String>,
    /// The model, by option (the same as MODEL): a checkpoint directory, a checkpoints root, a
    /// run directory (its newest valid checkpoint), a Hugging Face directory, or a Hub name
    /// `owner/name[@revision]` (fetched into the Hub cache; an existing path wins).
    #[arg(long, value_name = "PATH|OWNER/NAME", conflicts_with = "model")]
    checkpoint: Option<String>,
    #[command(flatten)]
    open: OpenArgs,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// The host part of --addr (vLLM's and llama-server's name), e.g. `0.0.0.0`.
    #[arg(long)]
    host: Option<String>,
    /// The port part of --addr (vLLM's and llama-server's name).
    #[arg(long)]
    port: Option<u16>,
    /// Sessions decoding at once; more wait in the queue. `auto`: the batcher's largest
    /// cohort (256) on a device with room for their states, else what its free memory holds;
    /// 64 on the CPU. The log says what was chosen and why.
    #[arg(long, default_value = "auto", value_name = "N|auto")]
    max_sessions: crate::capacity::MaxSessions,
    /// Requests that may wait for a session; past it the answer is "busy".
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Cohort sizes passes are padded up to, and warmed up before the server is ready:
    /// `ladder` (1, 2, 3, 4, then steps of 4 to 16, of 8 to 64 and of 16 to 256, cut at
    /// --max-sessions), `exact` (no padding) or a list such as `1,8,64`.
    #[arg(long, default_value = "ladder", value_name = "SIZES")]
    cohort_buckets: String,
    #[command(flatten)]
    passes: PassArgs,
    #[command(flatten)]
    prefix: PrefixArgs,
    /// Keep the prefix cache past a restart: when the server stops, every snapshot it holds
    /// is written to a folder of DIR named for the model and tokenizer; when a server of the
    /// same model starts on DIR, they come back into the host tier, the most recent first.
    #[arg(long, value_name = "DIR")]
    prefix_cache_dir: Option<std::path::PathBuf>,
    /// Take requests at once, without warming up: the first requests at each new batch shape
    /// then pay for kernel compilation and tuning.
    #[arg(long)]
    no_warmup: bool,
    /// Name reported by /v1/models (default: the checkpoint directory's name).
    #[arg(long)]
    model_name: Option<String>,
    /// An API key clients must send as `Authorization: Bearer KEY` on /v1/* and /ws
    /// (repeatable; also `$NSACTOR_API_KEY` and `--api-key-file`). Without any, the server is open.
    #[arg(long = "api-key", value_name = "KEY")]
    api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped).
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<std::path::PathBuf>,
    /// A browser origin on another site that may call the server (CORS; repeatable), such as
    /// `https://app.example.com`, or `*` for any. Without it, only the server's own pages can.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// The key that signs the state files this server exports (`/v1/state/export`, the
    /// WebSocket's `export`, `--prefix-cache-dir`) and that those it takes back must carry:
    /// servers that exchange state files share it. `$NSACTOR_STATE_KEY` (a secret of 16 bytes
    /// or more) comes first; else this file, made with a random key when missing (default
    /// `$XDG_CONFIG_HOME/nsactor/state-key`, else `~/.config/nsactor/state-key`).
    #[arg(long, value_name = "PATH")]
    state_key_file: Option<std::path::PathBuf>,
    /// /metrics needs an API key too (by default it stays open for scrapers).
    #[arg(long)]
    metrics_need_key: bool,
    /// /tokenize, /detokenize and /tokenizer_info need an API key too (by default they stay
    /// open, as vLLM leaves them: lm-evaluation-harness's remote tokenizer calls them without
    /// the completions' key unless given `auth_token=KEY`).
    #[arg(long)]
    tokenizer_need_key: bool,
    /// Seconds that running generations may take to finish after SIGTERM or SIGINT; those
    /// still running then end with finish reason `shutdown`. A second signal exits at once.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    shutdown_grace: f64,
    /// Worker threads of the server's own runtime (connections, text, events), apart from the
    /// pipeline's (0: the cores the pipeline leaves, at least 2).
    #[arg(long, default_value_t = 0, value_name = "N")]
    http_threads: usize,
    /// Rebuilds after a lost stage (a panic while decoding, a stopped actor) allowed within
    /// --rebuild-window: each fails the generations running then, rebuilds every actor and
    /// reads the checkpoint again. One more within the window and the command exits with an
    /// error (for the service manager to restart it).
    /// (`--max-restarts` is the former name.)
    #[arg(long, alias = "max-restarts", default_value_t = RestartPolicy::default().max_restarts, value_name = "N")]
    max_rebuilds: u32,
    /// Seconds over which --max-rebuilds counts (`--restart-window` is the former name).
    #[arg(long, alias = "restart-window", default_value_t = RestartPolicy::default().window.as_secs_f64(), value_name = "SECONDS")]
    rebuild_window: f64,
    /// Inject one failure to exercise recovery: `session-panic:LAYER:PASS` (that layer panics
    /// in its PASS-th decoding pass, the warm-up's included).
    #[arg(long, value_name = "FAULT")]
    inject_fault: Option<String>,
    #[command(flatten)]
    limits: LimitArgs,
}

/// How prompts are cut into passes (chunked prefill).
#[derive(clap::Args)]
pub struct PassArgs {
    /// Most input tokens of one pass (vLLM's name): a prompt prefilled while no other session
    /// is open goes in passes of this size, and prompts of one length prefill together up to
    /// it. 0: 16,384 / K (1,024 for the 0.9B, whose passes then hold ~13 GiB of activations on
    /// the GPU whatever the prompt's length).
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    max_num_batched_tokens: usize,
    /// Most tokens of one chunk of a prompt prefilled while other sessions decode: their steps
    /// run between its chunks, each waiting for one chunk at most. 0: 2,048 / K (128 for the
    /// 0.9B).
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    prefill_chunk_tokens: usize,
    /// Longest a chunk's pass may take beside decoding streams, as a share of one of their
    /// steps: chunks start at 8 tokens, are doubled (up to --prefill-chunk-tokens) while twice
    /// one fits and halved (down to 8) when one does not, so the streams' inter-token gaps
    /// stay within (1 + share) × a step where an 8-token chunk fits the share. 0: every chunk
    /// --prefill-chunk-tokens long.
    #[arg(long, default_value_t = nsactor_decoding::pacer::DEFAULT_SHARE, value_name = "SHARE",
          value_parser = share)]
    prefill_chunk_share: f64,
    /// Most sessions in one pass (vLLM's name): more decoding sessions go in further cohorts,
    /// as many in flight at once as the pipeline has stages (two stages on one GPU run two
    /// cohorts side by side, each on its stage's stream). 0: 256.
    #[arg(long, default_value_t = 0, value_name = "SESSIONS")]
    max_num_seqs: usize,
}

/// A share: a finite number ≥ 0.
fn share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a share ≥ 0 (for example 0.75; 0 turns pacing off)"
        )),
    }
}

impl PassArgs {
    /// `d` with these budgets, where set.
    pub fn apply(&self, mut d: nsactor_decoding::AsyncDecoder) -> nsactor_decoding::AsyncDecoder {
        if self.max_num_batched_tokens > 0 {
            d = d.with_pass_tokens(self.max_num_batched_tokens);
        }
        if self.prefill_chunk_tokens > 0 {
            d = d.with_chunk_tokens(self.prefill_chunk_tokens);
        }
        if self.max_num_seqs > 0 {
            d = d.with_pass_sessions(self.max_num_seqs);
        }
        d.with_chunk_share(self.prefill_chunk_share)
    }

    /// The cohort buckets `spec` names and their warm-up for a server of `sessions`, cut at
    /// the sessions one pass holds (a larger cohort never runs, so none is warmed up).
    pub fn warmup_plan(
        &self,
        spec: &str,
        sessions: usize,
    ) -> Result<(nsactor_decoding::buckets::CohortBuckets, WarmupPlan), String> {
        let pass = match self.max_num_seqs {
            0 => sessions,
            n => n.min(sessions),
        };
        WarmupPlan::for_spec(spec, pass)
    }
}

/// The prefix state cache: snapshots of sessions' states by the tokens they saw.
#[derive(clap::Args, Clone)]
pub struct PrefixArgs {
    /// MiB of device memory the prefix cache's snapshots may hold, over every device (one
    /// snapshot of the 0.9B is ~1.15 MB whatever the context). 0 turns the cache off.
    #[arg(long, default_value_t = 2048, value_name = "MIB")]
    pub prefix_cache_mib: u64,
    /// MiB of host memory for snapshots moved off the devices (0: evicted ones are dropped).
    #[arg(long, default_value_t = 8192, value_name = "MIB")]
    pub prefix_cache_host_mib: u64,
    /// A long prompt keeps a snapshot every this many tokens (0: at each prefill chunk).
    #[arg(long, default_value_t = 0, value_name = "TOKENS")]
    pub prefix_snapshot_every: usize,
    /// MiB of host memory for scored prompts' log-probabilities, kept beside their
    /// snapshots so that a prompt scored past a prefix scored before (lm-evaluation-harness's
    /// answers to one question) is fed only past it. 0: scoring does not use the cache.
    #[arg(long, default_value_t = 256, value_name = "MIB")]
    pub prefix_cache_score_mib: u64,
    /// Turns the prefix cache off (as --prefix-cache-mib 0).
    #[arg(long)]
    pub no_prefix_cache: bool,
}

impl PrefixArgs {
    pub fn config(&self) -> nsactor_decoding::prefix::PrefixConfig {
        let mib = |m: u64| m.saturating_mul(1 << 20);
        nsactor_decoding::prefix::PrefixConfig {
            device_bytes: if self.no_prefix_cache {
                0
            } else {
                mib(self.prefix_cache_mib)
            },
            host_bytes: mib(self.prefix_cache_host_mib),
            every: self.prefix_snapshot_every,
            score_bytes: mib(self.prefix_cache_score_mib),
            ..Default::default()
        }
    }
}

/// What one client may take.
#[derive(clap::Args)]
struct LimitArgs {
    /// Largest request body or WebSocket message; a bigger body gets a 413.
    #[arg(long, default_value_t = nsactor_server::protocol::DEFAULT_MAX_MESSAGE_BYTES, value_name = "BYTES")]
    max_body_bytes: usize,
    /// Most tokens of one prompt (a longer one is refused with a 400 naming both). The
    /// model's state is the same size after any number of tokens and a prompt is fed a pass
    /// at a time, so this bounds only the time a request may take to prefill.
    #[arg(long, default_value_t = nsactor_server::protocol::DEFAULT_MAX_PROMPT_TOKENS, value_name = "TOKENS")]
    max_prompt_tokens: usize,
    /// Most tokens one request may generate (`max_tokens` or `max_completion_tokens` past it
    /// is refused with a 400 naming this limit; a request naming none gets 128). Generating
    /// costs no memory per token, so this bounds only a request's time (with
    /// --request-timeout).
    #[arg(long, default_value_t = nsactor_server::protocol::DEFAULT_MAX_NEW_TOKENS, value_name = "TOKENS")]
    max_new_tokens: usize,
    /// Open connections; past it a new one gets a 503 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a connection has to send a request's headers (also: how long an idle
    /// keep-alive connection is kept).
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    header_timeout: f64,
    /// Seconds one generation may run; then it ends with finish reason `time_limit`
    /// (0: no limit).
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    request_timeout: f64,
    /// Seconds a WebSocket with nothing running (since its last request ended) may stay silent
    /// before it is closed; also how long a client may take no event before it counts as gone.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    ws_idle_timeout: f64,
}

impl LimitArgs {
    fn limits(&self) -> Result<nsactor_server::protocol::Limits, crate::result::CliError> {
        let secs = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(refuse(format!("--{name} must be seconds >= 0, got {v}")))
            }
        };
        let positive = |name: &str, v: f64| match secs(name, v)? {
            d if d.is_zero() => Err(refuse(format!("--{name} must be more than 0 seconds"))),
            d => Ok(d),
        };
        if self.max_body_bytes < 1024 {
            return Err(refuse("--max-body-bytes must be at least 1024"));
        }
        for (flag, v) in [
            ("max-connections", self.max_connections),
            ("max-prompt-tokens", self.max_prompt_tokens),
            ("max-new-tokens", self.max_new_tokens),
        ] {
            if v == 0 {
                return Err(refuse(format!("--{flag} must be at least 1")));
            }
        }
        let request = secs("request-timeout", self.request_timeout)?;
        Ok(nsactor_server::protocol::Limits {
            max_message_bytes: self.max_body_bytes,
            max_prompt_tokens: self.max_prompt_tokens,
            max_new_tokens: self.max_new_tokens,
            max_connections: self.max_connections,
            header_timeout: positive("header-timeout", self.header_timeout)?,
            request_time_limit: (!request.is_zero()).then_some(request),
            ws_idle_timeout: positive("ws-idle-timeout", self.ws_idle_timeout)?,
            ..Default::default()
        })
    }
}

/// The environment variable that adds one API key.
pub const API_KEY_ENV: &str = "NSACTOR_API_KEY";
/// The secret state files are signed with, before any key file.
pub const STATE_KEY_ENV: &str = "NSACTOR_STATE_KEY";

impl ServeArgs {
    /// `--shutdown-grace` as a duration.
    fn grace(&self) -> Result<Duration, crate::result::CliError> {
        if !(self.shutdown_grace.is_finite() && self.shutdown_grace >= 0.0) {
            return Err(refuse(format!(
                "--shutdown-grace must be seconds >= 0, got {}",
                self.shutdown_grace
            )));
        }
        Ok(Duration::from_secs_f64(self.shutdown_grace))
    }

    fn heal_policy(&self) -> Result<RestartPolicy, crate::result::CliError> {
        if !(self.rebuild_window.is_finite() && self.rebuild_window > 0.0) {
            return Err(refuse(format!(
                "--rebuild-window must be seconds > 0, got {}",
                self.rebuild_window
            )));
        }
        if let Some(f) = &self.inject_fault
            && !f.starts_with("session-panic:")
        {
            return Err(refuse(format!(
                "--inject-fault: a server can only inject `session-panic:LAYER:PASS`, got `{f}`"
            )));
        }
        Ok(RestartPolicy::new(
            self.max_rebuilds,
            Duration::from_secs_f64(self.rebuild_window),
        ))
    }

    /// The key state files are signed with, and where it came from (for the log).
    fn state_key(
        &self,
    ) -> Result<(nsactor_server::state_key::StateKey, String), crate::result::CliError> {
        use nsactor_server::state_key::StateKey;
        if let Ok(secret) = std::env::var(STATE_KEY_ENV) {
            if secret.trim().len() < 16 {
                return Err(refuse(format!(
                    "${STATE_KEY_ENV} holds {} bytes; a key is at least 16",
                    secret.trim().len()
                )));
            }
            return Ok((
                StateKey::from_secret(secret.trim().as_bytes()),
                format!("${STATE_KEY_ENV}"),
            ));
        }
        if let Some(path) = &self.state_key_file {
            let key = StateKey::load_or_create(path)?;
            return Ok((key, path.display().to_string()));
        }
        match StateKey::default_path() {
            Some(path) => match StateKey::load_or_create(&path) {
                Ok(key) => Ok((key, path.display().to_string())),
                // The default place may be read-only (a container's home): the server still
                // serves, its files trusted by itself alone, and the log says so.
                Err(e) => {
                    tracing::warn!(
                        "{e}; state files are signed with a key of this process alone (set \
                         ${STATE_KEY_ENV} or --state-key-file to keep them valid past a restart)"
                    );
                    Ok((StateKey::process(), "this process alone".into()))
                }
            },
            None => Ok((
                StateKey::process(),
                "a key of this process alone (no $HOME or $XDG_CONFIG_HOME for a key file)".into(),
            )),
        }
    }

    /// Every configured key: the flags, `$NSACTOR_API_KEY`, then the key file.
    fn keys(&self) -> Result<nsactor_server::auth::ApiKeys, crate::result::CliError> {
        let mut keys = self.api_keys.clone();
        if let Ok(k) = std::env::var(API_KEY_ENV) {
            keys.push(k);
        }
        if let Some(p) = &self.api_key_file {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("cannot read the API key file {}: {e}", p.display()))?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
        }
        for (asked, flag) in [
            (self.metrics_need_key, "--metrics-need-key"),
            (self.tokenizer_need_key, "--tokenizer-need-key"),
        ] {
            if keys.is_empty() && asked {
                return Err(refuse(format!(
                    "{flag} needs an API key (--api-key, $NSACTOR_API_KEY or --api-key-file)"
                )));
            }
        }
        let mut keys = nsactor_server::auth::ApiKeys::new(keys, self.metrics_need_key)?;
        keys.tokenizer = self.tokenizer_need_key;
        Ok(keys)
    }
}

pub fn run(a: ServeArgs) -> crate::result::CliResult {
    let started = Instant::now();
    let model = a
        .model
        .as_deref()
        .or(a.checkpoint.as_deref())
        .ok_or("no model to serve")?;
    // Every flag is checked before anything is loaded.
    let keys = a.keys()?;
    let limits = a.limits.limits()?;
    let heal = a.heal_policy()?;
    let grace = a.grace()?;
    let cors = nsactor_server::cors::Cors::parse(&a.cors_origins)?;
    let (state_key, key_from) = a.state_key()?;
    tracing::info!("state files are signed with the key of {key_from}");
    // Checked now; cut at the sessions chosen once the model is on its device.
    WarmupPlan::for_spec(&a.cohort_buckets, nsactor_decoding::batcher::MAX_BATCH)?;
    // SIGTERM/SIGINT start the drain; a second signal, or the grace period and the stop wait
    // running out, exits at once.
    let stop = nsactor_training::shutdown::stop_on_signals(
        grace + STOP_WAIT + Duration::from_secs(5),
        "refusing new requests and letting running generations finish",
    )?;
    let l = launch::load_checkpoint(&launch::CheckpointOptions {
        inject_fault: a.inject_fault.clone(),
        ..a.open.options(model)?
    })?;
    let max_sessions = {
        let memory = crate::capacity::device_memory(l.pipeline.backend().as_ref());
        let cache = a.prefix.prefix_cache_mib << 20;
        let (n, why) =
            crate::capacity::sessions(a.max_sessions, memory.as_deref(), &l.config.model, cache);
        tracing::info!("--max-sessions {n} ({why})");
        n
    };
    let (buckets, plan) = a.passes.warmup_plan(&a.cohort_buckets, max_sessions)?;
    if keys.required() {
        tracing::info!(
            "{} API key(s) required on /v1/* and /ws{}",
            keys.count(),
            if keys.metrics { " and /metrics" } else { "" }
        );
    }
    let ready = Readiness::for_plan(a.no_warmup, &plan);
    let decoder = a.passes.apply(l.pipeline.decoder(l.vocab));
    let state = ServerState::new(
        (decoder, l.tokenizer.clone(), a.prefix.config()),
        (max_sessions, a.max_queue),
        a.model_name.clone().unwrap_or_else(|| l.name.clone()),
        (keys, cors, state_key),
        (limits, ready.clone()),
    );
    let decoder = state.generator.decoder.clone();
    decoder.set_buckets(buckets);
    decoder.set_heal_policy(heal);
    // The server runs on its own runtime; the actors stay on the pipeline's.
    let front = nsactor_server::front::front_runtime(a.http_threads)
        .map_err(|e| format!("the server's runtime: {e}"))?;
    front.block_on(async {
        let addr = listen_addr(&a.addr, a.host.as_deref(), a.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        // From here a signal drains the running generations; before, it exits at once.
        stop.arm();
        tracing::info!(
            "serving on http://{} (WebSocket /ws, OpenAI /v1/completions and /v1/chat/completions, chat page /)",
            listener.local_addr()?
        );
        let drain = state.generator.drain.clone();
        let drain_on_failure = drain.clone();
        let shutdown = async move {
            while stop.requested().is_none() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let d = drain.shutdown(grace, STOP_WAIT).await;
            tracing::info!(
                "shut down: {} generation(s) running at the signal, {} ended by the grace period, {} left",
                d.running_at_start,
                d.stopped,
                d.left
            );
            // The final events are queued; give the connections' writers a moment to send them.
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if let Some(dir) = &a.prefix_cache_dir {
            let l = nsactor_server::persist::load(&state, dir).await?;
            tracing::info!(
                "prefix cache: {} snapshot(s) from {} in the host tier, {} left out for room, {} refused",
                l.adopted,
                nsactor_server::persist::folder(&state, dir).display(),
                l.left,
                l.refused.len()
            );
        }
        let kept = state.clone();
        let mut server = tokio::spawn(nsactor_server::serve(listener, state, shutdown));
        if !a.no_warmup {
            // A signal during the warm-up ends the server, and the command with it.
            tokio::select! {
                w = ready.warm_up(&decoder, &plan, started) => w?,
                s = &mut server => return Ok(s.map_err(|e| e.to_string())??),
            }
        }
        tokio::select! {
            s = &mut server => {
                s.map_err(|e| e.to_string())??;
                if let Some(dir) = &a.prefix_cache_dir {
                    let w = nsactor_server::persist::save(&kept, dir).await?;
                    tracing::info!(
                        "prefix cache: {} snapshot(s), {:.1} MiB, written to {}",
                        w.files,
                        w.bytes as f64 / (1 << 20) as f64,
                        w.folder.display()
                    );
                }
            }
            why = decoding_failed(&decoder) => {
                // Refuse new requests and let the errors already on their way reach their
                // clients before the process goes (nothing decodes any more: a second at most).
                let second = Duration::from_secs(1);
                drain_on_failure.shutdown(second, second).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Err(format!("decoding has failed, exiting: {why}").into());
            }
        }
        Ok::<_, crate::result::CliError>(())
    })
}

/// Resolves once `decoder` has failed for good (past --max-rebuilds, or a rebuild that
/// failed), with why.
async fn decoding_failed(decoder: &AsyncDecoder) -> String {
    let mut changes = decoder.health_changes();
    match changes
        .wait_for(|h| matches!(h, Health::Failed { .. }))
        .await
    {
        Ok(h) => match &*h {
            Health::Failed { cause } => cause.clone(),
            _ => unreachable!("waited for a failure"),
        },
        Err(_) => "the decoder stopped".into(),
    }
}

/// `addr` with its host and port replaced by `host` and `port` where given (an IPv6 host
/// goes in brackets).
fn listen_addr(addr: &str, host: Option<&str>, port: Option<u16>) -> String {
    let (h, p) = addr.rsplit_once(':').unwrap_or((addr, "8080"));
    let h = host.map_or_else(
        || h.to_string(),
        |h| match h.contains(':') && !h.starts_with('[') {
            true => format!("[{h}]"),
            false => h.to_string(),
        },
    );
    let p = port.map_or_else(|| p.to_string(), |p| p.to_string());
    format!("{h}:{p}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_and_port_replace_their_parts_of_addr() {
        use super::listen_addr;
        assert_eq!(listen_addr("127.0.0.1:8080", None, None), "127.0.0.1:8080");
        assert_eq!(
            listen_addr("127.0.0.1:8080", None, Some(8000)),
            "127.0.0.1:8000"
        );
        assert_eq!(
            listen_addr("127.0.0.1:8080", Some("0.0.0.0"), None),
            "0.0.0.0:8080"
        );
        assert_eq!(listen_addr("[::1]:9", Some("::"), Some(80)), "[::]:80");
    }

    #[test]
    fn a_chunk_share_is_a_finite_number_at_least_zero() {
        assert_eq!(super::share("0.75"), Ok(0.75));
        assert_eq!(super::share("0"), Ok(0.0));
        for bad in ["-0.1", "nan", "inf", "abc", ""] {
            let e = super::share(bad).unwrap_err();
            assert!(e.contains("is not a share ≥ 0"), "{bad}: {e}");
        }
    }
}
