//! `[train] keep_activations`: how many layers per pipeline stage keep their forward's autodiff
//! graph until their backward instead of recomputing it: a number, or `auto` (chosen from the
//! device memory measured over the run's first steps, under `[train] memory_budget_gib`).

use crate::error::RuntimeError;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// See [`TrainConfig::keep_activations`](crate::config::TrainConfig::keep_activations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepActivations {
    /// Chosen at run time from the device memory the first steps take (where the backend
    /// reports device memory; `0` where it does not, as on the CPU).
    #[default]
    Auto,
    /// This many layers per stage, counted from its last.
    Layers(usize),
}

impl KeepActivations {
    /// The number of layers, unless it is to be chosen (`auto`).
    pub fn fixed(self) -> Option<usize> {
        match self {
            KeepActivations::Auto => None,
            KeepActivations::Layers(n) => Some(n),
        }
    }

    pub fn is_auto(self) -> bool {
        self == KeepActivations::Auto
    }
}

impl From<usize> for KeepActivations {
    fn from(n: usize) -> Self {
        KeepActivations::Layers(n)
    }
}

impl std::fmt::Display for KeepActivations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeepActivations::Auto => f.write_str("auto"),
            KeepActivations::Layers(n) => write!(f, "{n}"),
        }
    }
}

impl std::str::FromStr for KeepActivations {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self, RuntimeError> {
        match s.trim() {
            "auto" => Ok(KeepActivations::Auto),
            n => n.parse().map(KeepActivations::Layers).map_err(|_| {
                RuntimeError::Invalid(format!(
                    "keep_activations must be `auto` or a number of layers, got `{s}`"
                ))
            }),
        }
    }
}

impl Serialize for KeepActivations {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            KeepActivations::Auto => s.serialize_str("auto"),
            KeepActivations::Layers(n) => s.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for KeepActivations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = KeepActivations;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("`auto` or a number of layers")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Self::Value, E> {
                Ok(KeepActivations::Layers(n as usize))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Self::Value, E> {
                usize::try_from(n)
                    .map(KeepActivations::Layers)
                    .map_err(|_| E::custom(format!("`auto` or a number of layers, got {n}")))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Self::Value, E> {
                s.parse()
                    .map_err(|e: RuntimeError| E::custom(e.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// `[train] memory_budget_gib`: a positive number of GiB where given.
pub(super) fn check_budget(gib: Option<f64>) -> Result<(), String> {
    match gib {
        Some(b) if !(b.is_finite() && b > 0.0) => Err(format!(
            "`memory_budget_gib` must be a positive number of GiB, got {b}"
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::KeepActivations::{self, Auto, Layers};
    use crate::config::{DEFAULT_CONFIG, EnvLayer, Overrides, RunConfig};

    fn with_train(lines: &str) -> Result<RunConfig, crate::error::RuntimeError> {
        let text = DEFAULT_CONFIG.replacen("[train]\n", &format!("[train]\n{lines}\n"), 1);
        RunConfig::from_str(&text, "test.toml")
    }

    #[test]
    fn the_file_the_environment_and_the_flags_set_it_and_auto_is_the_default() {
        assert_eq!(with_train("").unwrap().train.keep_activations, Auto);
        assert_eq!(with_train("").unwrap().train.memory_budget_gib, None);
        let c = with_train("keep_activations = 6\nmemory_budget_gib = 120.5").unwrap();
        assert_eq!(c.train.keep_activations, Layers(6));
        assert_eq!(c.train.memory_budget_gib, Some(120.5));
        let c = with_train("keep_activations = \"auto\"").unwrap();
        assert_eq!(c.train.keep_activations, Auto);
        for (value, want) in [("4", Layers(4)), ("auto", Auto)] {
            let env = EnvLayer::from_vars([(
                "NSACTOR_TRAIN__KEEP_ACTIVATIONS".to_string(),
                value.to_string(),
            )]);
            let c = RunConfig::load_with(None, &env).unwrap();
            assert_eq!(c.train.keep_activations, want, "{value}");
        }
        let mut c = with_train("keep_activations = 2").unwrap();
        c.apply(&Overrides {
            keep_activations: Some(Auto),
            ..Overrides::default()
        })
        .unwrap();
        assert_eq!(c.train.keep_activations, Auto);
    }

    #[test]
    fn a_checkpoints_config_text_reads_back_the_same() {
        for lines in [
            "",
            "keep_activations = 7",
            "keep_activations = \"auto\"\nmemory_budget_gib = 96.5",
        ] {
            let c = with_train(lines).unwrap();
            let back = RunConfig::from_str(&c.to_toml(), "manifest").unwrap();
            assert_eq!(
                back.train.keep_activations, c.train.keep_activations,
                "{lines}"
            );
            assert_eq!(
                back.train.memory_budget_gib, c.train.memory_budget_gib,
                "{lines}"
            );
        }
    }

    #[test]
    fn bad_values_are_refused_naming_the_key_and_what_it_takes() {
        let e = with_train("keep_activations = \"all\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("keep_activations") && e.contains("`auto` or a number"),
            "{e}"
        );
        let e = with_train("keep_activations = -2").unwrap_err().to_string();
        assert!(e.contains("keep_activations"), "{e}");
        for bad in ["0", "-1", "nan"] {
            let e = with_train(&format!("memory_budget_gib = {bad}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("memory_budget_gib"), "{bad}: {e}");
        }
    }

    #[test]
    fn numbers_and_auto_parse_and_anything_else_is_refused_by_name() {
        assert_eq!("auto".parse::<KeepActivations>().unwrap(), Auto);
        assert_eq!("6".parse::<KeepActivations>().unwrap(), Layers(6));
        let e = "most".parse::<KeepActivations>().unwrap_err().to_string();
        assert!(
            e.contains("`auto` or a number") && e.contains("most"),
            "{e}"
        );
        assert!("-1".parse::<KeepActivations>().is_err());
        assert_eq!(Auto.to_string(), "auto");
        assert_eq!(Layers(3).to_string(), "3");
        assert_eq!((Auto.fixed(), Layers(4).fixed()), (None, Some(4)));
    }
}
