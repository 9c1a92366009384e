//! A model to open, found from the path a user gives: a checkpoint (that directory, or the
//! newest valid one under a run directory or checkpoints root) or a Hugging Face directory.
//! [`ModelSource::open`] finds it, reads its run configuration and weights, loads its tokenizer
//! (or the one given) and checks that the model can hold it: everything a command needs before
//! it starts a pipeline, in one place. [`ModelSource::weights`] then hands the weights to the
//! stages, and reads the same checkpoint again, verified anew, whenever the actors are rebuilt.

use crate::checkpoint::{check_tokenizer, find_checkpoint};
use crate::export::{is_hf_dir, read_hf};
use nsactor_data::Tokenizer;
use nsactor_engine::config::RunConfig;
use nsactor_engine::error::RuntimeError;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

/// Where a pipeline's weights come from: its shards in stage order (edge first; one buffer
/// may feed several stages), read again whenever the pipeline is rebuilt.
pub type WeightSource = Arc<dyn Fn() -> Result<Vec<Arc<Vec<u8>>>, RuntimeError> + Send + Sync>;

/// What a [`ModelSource`] was found as.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// A checkpoint directory (with its manifest) and the step it was written at.
    Checkpoint { dir: PathBuf, step: u64 },
    /// A Hugging Face directory (`config.json`, `model.safetensors`, `tokenizer.json`).
    HuggingFace { dir: PathBuf },
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Checkpoint { dir, step } => write!(f, "{} (step {step})", dir.display()),
            Origin::HuggingFace { dir } => {
                write!(f, "the Hugging Face directory {}", dir.display())
            }
        }
    }
}

/// A model found on disk, its weights read and its tokenizer checked.
pub struct ModelSource {
    /// The run's configuration (a checkpoint's manifest), or the embedded default run with the
    /// Hugging Face model.
    pub config: RunConfig,
    pub tokenizer: Tokenizer,
    pub origin: Origin,
    /// The run's name (its directory's), or the Hugging Face directory's.
    pub name: String,
    /// The weights as first read: one shard per stage, or one file for every stage.
    first: Vec<Vec<u8>>,
}

impl ModelSource {
    /// Finds the model at `path` and reads it; `tokenizer` replaces the model's own.
    pub fn open(path: &Path, tokenizer: Option<&Path>) -> Result<Self, RuntimeError> {
        let name_of = |p: Option<&Path>| {
            p.and_then(Path::file_name)
                .map_or("nsactor".into(), |n| n.to_string_lossy().into_owned())
        };
        if is_hf_dir(path) {
            let hf = read_hf(path)?;
            let tok = match tokenizer {
                Some(p) => Tokenizer::load(p)?,
                None => hf.tokenizer,
            };
            let mut config = RunConfig::load(None)?;
            config.model = hf.model;
            check_tokenizer(&config, &tok)?;
            return Ok(ModelSource {
                config,
                tokenizer: tok,
                origin: Origin::HuggingFace {
                    dir: path.to_path_buf(),
                },
                name: name_of(Some(path)),
                first: vec![hf.weights],
            });
        }
        let ck = find_checkpoint(path)?;
        let config = RunConfig::from_str(&ck.manifest.config, &ck.dir.display().to_string())?;
        let tok_path = tokenizer.or(config.data.tokenizer.as_deref());
        let tok = Tokenizer::load_or_bundled(tok_path)?;
        ck.manifest.check_tokenizer(&ck.dir, &tok)?;
        // `run/checkpoints/step-N`: the run's name is `run`.
        let run = ck.dir.parent().and_then(Path::parent);
        Ok(ModelSource {
            config,
            tokenizer: tok,
            name: name_of(run),
            origin: Origin::Checkpoint {
                dir: ck.dir,
                step: ck.manifest.step,
            },
            first: ck.shards,
        })
    }

    /// The weights for a pipeline of `stages` stages: those already read, once, then the same
    /// checkpoint (or Hugging Face file) read again at each call: a rebuild after a lost stage
    /// loads what this source named, not a newer checkpoint a run has written since.
    pub fn weights(&mut self, stages: usize) -> WeightSource {
        let shared = matches!(self.origin, Origin::HuggingFace { .. });
        // Every stage reads its own tensors from the one Hugging Face file: one buffer for all.
        let per_stage = move |files: Vec<Vec<u8>>| -> Vec<Arc<Vec<u8>>> {
            if shared {
                let one = Arc::new(files.into_iter().next().unwrap_or_default());
                (0..stages).map(|_| one.clone()).collect()
            } else {
                files.into_iter().map(Arc::new).collect()
            }
        };
        let first = Mutex::new(Some(per_stage(std::mem::take(&mut self.first))));
        let origin = self.origin.clone();
        Arc::new(move || {
            if let Some(first) = first.lock().unwrap_or_else(PoisonError::into_inner).take() {
                return Ok(first);
            }
            let files = match &origin {
                Origin::Checkpoint { dir, .. } => find_checkpoint(dir)?.shards,
                Origin::HuggingFace { dir } => vec![read_hf(dir)?.weights],
            };
            Ok(per_stage(files))
        })
    }
}
