//! Moving weights to and from the reference ecosystem: `nsactor export --format hf` writes a
//! Hugging Face directory (`config.json`, `model.safetensors` with the reference's `model.`-
//! prefixed names, `tokenizer.json`) from a checkpoint; `nsactor import --format hf` turns
//! such a directory into a run directory with a step-0 checkpoint that `nsactor train --resume`
//! continues from.

use crate::checkpoint::{self, CheckpointMeta, find_checkpoint};
use crate::hub::{WEIGHTS, WEIGHTS_INDEX};
use nsactor_data::Tokenizer;
use nsactor_engine::config::RunConfig;
use nsactor_engine::engine::StagedModel;
use nsactor_engine::error::RuntimeError;
use nsactor_plugin_api::{ComputeBackend, ModelConfig, OptimizerKind, PlifOut};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Prefix of every tensor name in a Hugging Face NeuronSpark `model.safetensors`.
pub const HF_PREFIX: &str = "model.";

/// `config.json` of a Hugging Face NeuronSpark directory: the reference's keys, plus
/// `nsactor_plif_out` (which neuron output the weights were trained with, SPEC §0.1).
pub fn hf_config(model: &ModelConfig) -> serde_json::Value {
    serde_json::json!({
        "model_type": "neuronspark",
        "architectures": ["NeuronSparkForCausalLM"],
        "vocab_size": model.vocab_size,
        "D": model.d,
        "N": model.n,
        "K": model.k,
        "num_layers": model.num_layers,
        "D_ff": model.d_ff,
        "v_th_min": model.v_th_min,
        "nsactor_plif_out": match model.plif_out {
            PlifOut::Leak => "leak",
            PlifOut::VPost => "v_post",
        },
        "torch_dtype": "float32",
        "auto_map": {
            "AutoConfig": "configuration_neuronspark.NeuronSparkConfig",
            "AutoModelForCausalLM": "modeling_neuronspark.NeuronSparkForCausalLM",
        },
    })
}

/// The model code an export carries for `transformers` (`trust_remote_code=True` loads it
/// through `config.json`'s `auto_map`): nsactor's own PyTorch reference implementation,
/// written from the specification (`hf_python/`), by file name.
pub const HF_MODEL_CODE: [(&str, &str); 2] = [
    (
        "configuration_neuronspark.py",
        include_str!("hf_python/configuration_neuronspark.py"),
    ),
    (
        "modeling_neuronspark.py",
        include_str!("hf_python/modeling_neuronspark.py"),
    ),
];

/// The model of a Hugging Face `config.json`.
pub fn model_from_hf(config: &serde_json::Value) -> Result<ModelConfig, RuntimeError> {
    let int = |k: &str| {
        config[k]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| RuntimeError::Invalid(format!("config.json: `{k}` must be an integer")))
    };
    let plif_out = match config["nsactor_plif_out"].as_str().unwrap_or("leak") {
        "leak" => PlifOut::Leak,
        "v_post" => PlifOut::VPost,
        other => {
            return Err(RuntimeError::Invalid(format!(
                "config.json: nsactor_plif_out `{other}` (leak or v_post)"
            )));
        }
    };
    let model = ModelConfig {
        vocab_size: int("vocab_size")?,
        d: int("D")?,
        n: int("N")?,
        k: int("K")?,
        num_layers: int("num_layers")?,
        d_ff: int("D_ff")?,
        // Not saved by every exporter; every reference loader uses 0.1 (SPEC §1.1).
        v_th_min: config["v_th_min"].as_f64().unwrap_or(0.1),
        plif_out,
    };
    model
        .validate()
        .map_err(|e| RuntimeError::Invalid(format!("config.json: {e}")))?;
    Ok(model)
}

/// Writes `out/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
/// generation_config.json}` and the model code ([`HF_MODEL_CODE`]) from the checkpoint at
/// `checkpoint` (see [`find_checkpoint`]). The tokenizer is `tokenizer` or the run's, and must
/// be the one the checkpoint was trained with.
pub fn export_hf(
    checkpoint: &Path,
    out: &Path,
    tokenizer: Option<&Path>,
) -> Result<PathBuf, RuntimeError> {
    let l = find_checkpoint(checkpoint)?;
    let cfg = RunConfig::from_str(&l.manifest.config, &format!("{}", l.dir.display()))?;
    let tok_path = tokenizer
        .map(Path::to_path_buf)
        .or(cfg.data.tokenizer.clone());
    let tok = nsactor_data::Tokenizer::load_or_bundled(tok_path.as_deref())?;
    l.manifest.check_tokenizer(&l.dir, &tok)?;
    let merged = crate::weights::MergedParams::new(&l.shards, HF_PREFIX)?;
    std::fs::create_dir_all(out)
        .map_err(|e| format!("{}: {e}", out.display()))
        .map_err(convert)?;
    let weights = out.join("model.safetensors");
    merged
        .write_file(&weights)
        .map_err(|e| format!("{}: {e}", weights.display()))
        .map_err(convert)?;
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        crate::weights::write_atomic(&p, bytes).map_err(|e| format!("{}: {e}", p.display()))
    };
    write(
        "config.json",
        serde_json::to_string_pretty(&with_token_ids(hf_config(&cfg.model), &tok))
            .map_err(convert)?
            .as_bytes(),
    )
    .map_err(convert)?;
    write("tokenizer.json", tok.to_json(true)?.as_bytes()).map_err(convert)?;
    let json = |v: serde_json::Value| serde_json::to_string_pretty(&v).map_err(convert);
    write(
        "tokenizer_config.json",
        json(tok.hf_tokenizer_config(MODEL_MAX_LENGTH))?.as_bytes(),
    )
    .map_err(convert)?;
    write(
        "generation_config.json",
        json(generation_config(&tok))?.as_bytes(),
    )
    .map_err(convert)?;
    for (name, code) in HF_MODEL_CODE {
        write(name, code.as_bytes()).map_err(convert)?;
    }
    Ok(l.dir)
}

/// The longest input an export's tokenizer configuration names. The model itself has no
/// context limit (its state is the same size after any number of tokens); this is the figure
/// tools that read `model_max_length` get, far above the training windows.
pub const MODEL_MAX_LENGTH: usize = 131_072;

/// `generation_config.json`: the ids generation starts and stops with (`transformers`'
/// `GenerationConfig`).
pub fn generation_config(tok: &nsactor_data::Tokenizer) -> serde_json::Value {
    serde_json::json!({
        "bos_token_id": tok.bos_id(),
        "eos_token_id": tok.eos_id(),
        "pad_token_id": nsactor_data::tokenizer::PAD_ID,
    })
}

/// `config` with the tokenizer's special ids beside the model's keys, as `transformers`'
/// `PretrainedConfig` carries them (its defaults are not this tokenizer's).
pub fn with_token_ids(
    mut config: serde_json::Value,
    tok: &nsactor_data::Tokenizer,
) -> serde_json::Value {
    if let (Some(c), serde_json::Value::Object(ids)) =
        (config.as_object_mut(), generation_config(tok))
    {
        c.extend(ids);
    }
    config
}

/// A Hugging Face NeuronSpark directory as read: its model, weights and tokenizer.
pub struct HfModel {
    pub model: ModelConfig,
    /// `model.safetensors` as it is (`model.`-prefixed names, which every stage reads).
    pub weights: Vec<u8>,
    pub tokenizer: Tokenizer,
}

/// Whether `dir` looks like a Hugging Face directory (`config.json` and `model.safetensors`,
/// or the shards' `model.safetensors.index.json`; no checkpoint manifest).
pub fn is_hf_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
        && (dir.join(WEIGHTS).is_file() || dir.join(WEIGHTS_INDEX).is_file())
        && !dir.join(checkpoint::MANIFEST).exists()
}

/// The weights of the Hugging Face directory `hf` as one safetensors buffer: its
/// `model.safetensors`, or the shards its `model.safetensors.index.json` names, joined.
pub fn read_hf_weights(hf: &Path) -> Result<Vec<u8>, RuntimeError> {
    let read = |p: PathBuf| std::fs::read(&p).map_err(|e| convert(format!("{}: {e}", p.display())));
    if hf.join(WEIGHTS).is_file() || !hf.join(WEIGHTS_INDEX).is_file() {
        // Checked whole here (a truncated or foreign file is refused naming it), before a
        // backend is opened and each stage reads its tensors from it.
        let path = hf.join(WEIGHTS);
        let bytes = read(path.clone())?;
        SafeTensors::deserialize(&bytes).map_err(|e| {
            convert(format!(
                "{}: not a whole safetensors file: {e}",
                path.display()
            ))
        })?;
        return Ok(bytes);
    }
    let files = crate::hub::shards(hf)?
        .into_iter()
        .map(|f| read(hf.join(f)))
        .collect::<Result<Vec<_>, _>>()?;
    let parsed = files
        .iter()
        .map(|b| SafeTensors::deserialize(b).map_err(convert))
        .collect::<Result<Vec<_>, _>>()?;
    let mut views = Vec::new();
    for st in &parsed {
        views.extend(st.tensors());
    }
    safetensors::serialize(views, None).map_err(convert)
}

/// Reads the Hugging Face directory `hf` (`config.json`, `model.safetensors` or its shards,
/// `tokenizer.json`).
pub fn read_hf(hf: &Path) -> Result<HfModel, RuntimeError> {
    let read = |name: &str| {
        let p = hf.join(name);
        std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))
    };
    let config: serde_json::Value = serde_json::from_slice(&read("config.json").map_err(convert)?)
        .map_err(|e| format!("{}: {e}", hf.join("config.json").display()))
        .map_err(convert)?;
    let tokenizer = Tokenizer::from_json(
        std::str::from_utf8(&read("tokenizer.json").map_err(convert)?).map_err(convert)?,
        &hf.join("tokenizer.json").display().to_string(),
    )?;
    Ok(HfModel {
        model: model_from_hf(&config)?,
        weights: read_hf_weights(hf)?,
        tokenizer,
    })
}

/// Makes `out` a run directory from the Hugging Face directory `hf`: `config.toml` (the HF
/// model with the embedded default `[train]`), `tokenizer.json` and
/// `checkpoints/step-00000000` (the weights, fresh optimizer state), the config naming them by
/// absolute paths. `nsactor train --config out/config.toml --resume` then trains on from them.
pub fn import_hf(
    hf: &Path,
    out: &Path,
    backend: Arc<dyn ComputeBackend>,
) -> Result<PathBuf, RuntimeError> {
    let HfModel {
        model,
        weights,
        tokenizer: tok,
    } = read_hf(hf)?;
    std::fs::create_dir_all(out)
        .map_err(|e| format!("{}: {e}", out.display()))
        .map_err(convert)?;
    // The config's paths are absolute: `train --config out/config.toml` reads them from
    // wherever it is started, where a relative `--out` would name another folder.
    let out = &std::path::absolute(out)
        .map_err(|e| format!("{}: {e}", out.display()))
        .map_err(convert)?;
    let tok_path = out.join("tokenizer.json");
    let mut cfg = RunConfig::load(None)?;
    cfg.model = model;
    cfg.train.out_dir = out.to_path_buf();
    cfg.data.tokenizer = Some(tok_path.clone());
    crate::checkpoint::check_tokenizer(&cfg, &tok)?;
    let mut model = StagedModel::open(
        backend,
        &cfg.model,
        cfg.train.seed,
        OptimizerKind::Adam,
        None,
    )?;
    model.load_model_bytes(&weights)?;
    let shards = model.save_stages()?;
    let text = toml::to_string(&cfg).map_err(convert)?;
    let dir = checkpoint::write(
        &out.join("checkpoints"),
        &CheckpointMeta {
            step: 0,
            data_cursor: None,
            seed: cfg.train.seed,
            config: text.clone(),
            tokenizer_sha256: Some(tok.hash().to_string()),
        },
        &shards,
        0,
    )?;
    tok.save(&tok_path)?;
    crate::weights::write_atomic(&out.join("config.toml"), text.as_bytes()).map_err(convert)?;
    Ok(dir)
}

/// A failure reading or writing a Hugging Face directory, as the runtime's error.
fn convert(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Convert(e.to_string())
}
