//! The layered configuration's schedule and backend tables under test.

mod schedule_tests {
    use crate::config::Schedule;

    #[test]
    fn auto_keeps_the_cpu_backend_reproducible_and_overlaps_elsewhere() {
        assert_eq!(Schedule::default(), Schedule::Auto);
        assert_eq!(Schedule::Auto.resolve("ndarray"), Schedule::Fifo);
        assert_eq!(Schedule::Auto.resolve("cuda"), Schedule::DepthFirst);
        assert_eq!(Schedule::Fifo.resolve("cuda"), Schedule::Fifo);
        assert_eq!(
            Schedule::DepthFirst.resolve("ndarray"),
            Schedule::DepthFirst
        );
        let parsed: Schedule = toml::from_str::<toml::Value>("s = \"auto\"").unwrap()["s"]
            .clone()
            .try_into()
            .unwrap();
        assert_eq!(parsed, Schedule::Auto);
    }
}

mod backend_tests {
    use crate::config::{DEFAULT_CONFIG, RunConfig};

    fn with(backend: &str) -> Result<RunConfig, crate::error::RuntimeError> {
        RunConfig::from_str(&format!("{DEFAULT_CONFIG}\n[backend]\n{backend}"), "test")
    }

    #[test]
    fn backend_options_reach_the_plugin_and_bad_values_are_refused() {
        let cfg = with("precision = \"bf16\"\nstreams = \"per-thread\"\n").unwrap();
        assert_eq!(
            cfg.backend.plugin_options(),
            "precision=bf16,streams=per-thread"
        );
        let cfg = with("streams = \"shared\"\n").unwrap();
        assert_eq!(cfg.backend.plugin_options(), "streams=shared");
        assert_eq!(with("").unwrap().backend.plugin_options(), "");
        let e = with("streams = \"two\"\n").unwrap_err().to_string();
        assert!(e.contains("streams") && e.contains("per-thread"), "{e}");
    }

    #[test]
    fn kernel_knobs_are_typed_at_load_and_a_bad_one_is_named() {
        let cfg = with("[backend.kernels]\nscan_cube = 64\nstage_row_forward = \"8x32\"\ndecode_fusion = false\n")
            .unwrap();
        let t = cfg.backend.kernel_table().unwrap();
        assert_eq!(t.scan_cube, 64);
        assert!(!t.decode_fusion);
        assert_eq!(t.stage_row_forward.unwrap().chunk, 32);
        let back = RunConfig::from_str(&cfg.to_toml(), "manifest").unwrap();
        assert_eq!(back.backend.kernels, cfg.backend.kernels);
        let e = with("[backend.kernels]\nscan_cubes = 64\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[backend.kernels] scan_cubes") && e.contains("scan_cube,"),
            "{e}"
        );
        let e = with("[backend.kernels]\nstage_async = \"4x12\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage_async") && e.contains("PxCxD"), "{e}");
    }
}

mod toml_range_tests {
    use crate::config::{DEFAULT_CONFIG, EnvLayer, Overrides, RunConfig};

    /// A value TOML cannot hold (past 2^63 − 1) is refused naming its key, from the
    /// environment, the file or the command line, instead of panicking when the first
    /// checkpoint's manifest is written.
    #[test]
    fn integers_past_what_toml_holds_are_refused_by_name() {
        let env = EnvLayer::from_vars([(
            "NSACTOR_TRAIN__SEED".to_string(),
            "9223372036854775808".to_string(),
        )]);
        let e = RunConfig::load_with(None, &env).unwrap_err().to_string();
        assert!(
            e.contains("train.seed") && e.contains("9223372036854775807"),
            "{e}"
        );
        // A float in the file read into an integer key: refused, naming it.
        let text = DEFAULT_CONFIG.replace("steps = 300", "steps = 1e20");
        assert_ne!(text, DEFAULT_CONFIG);
        let e = RunConfig::from_str(&text, "big.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("big.toml"), "{e}");
        let mut cfg = RunConfig::from_str(DEFAULT_CONFIG, "embedded").unwrap();
        let o = Overrides {
            seed: Some(u64::MAX),
            ..Overrides::default()
        };
        let e = cfg.apply(&o).unwrap_err().to_string();
        assert!(e.contains("train.seed"), "{e}");
        // The largest value TOML holds is taken.
        let o = Overrides {
            seed: Some(i64::MAX as u64),
            ..Overrides::default()
        };
        cfg.apply(&o).unwrap();
        assert!(cfg.to_toml().contains("seed = 9223372036854775807"));
    }
}

mod env_tests {
    use crate::config::{EnvLayer, RunConfig};

    /// A nested table's key from the environment: one more `__` between the tables.
    #[test]
    fn a_nested_tables_key_is_set_from_the_environment() {
        let env = EnvLayer::from_vars([
            (
                "NSACTOR_BACKEND__KERNELS__SCAN_CUBE".to_string(),
                "64".to_string(),
            ),
            ("NSACTOR_MODEL__NUM_LAYERS".to_string(), "3".to_string()),
        ]);
        let cfg = RunConfig::load_with(None, &env).unwrap();
        assert_eq!(cfg.backend.kernel_table().unwrap().scan_cube, 64);
        assert_eq!(cfg.model.num_layers, 3);
        let env = EnvLayer::from_vars([(
            "NSACTOR_BACKEND__KERNELS__SCAN_CUBES".to_string(),
            "64".to_string(),
        )]);
        let e = RunConfig::load_with(None, &env).unwrap_err().to_string();
        assert!(e.contains("scan_cubes") && e.contains("scan_cube,"), "{e}");
    }
}

mod wording_tests {
    use crate::config::{DEFAULT_CONFIG, RunConfig};

    /// The error for the embedded default with `key`'s line set to `key = value`.
    fn refused(key: &str, value: &str) -> String {
        let prefix = format!("{key} = ");
        let text: Vec<String> = DEFAULT_CONFIG
            .lines()
            .map(|l| match l.starts_with(&prefix) {
                true => format!("{prefix}{value}"),
                false => l.to_string(),
            })
            .collect();
        assert_ne!(text.join("\n"), DEFAULT_CONFIG.trim_end(), "{key}");
        RunConfig::from_str(&text.join("\n"), "test.toml")
            .err()
            .unwrap_or_else(|| panic!("`{key} = {value}` was taken"))
            .to_string()
    }

    #[test]
    fn bad_values_are_named_by_key_in_the_users_words_never_by_rust_type() {
        let cases = [
            (
                "plif_out",
                "\"bogus\"",
                "[model.plif_out]: unknown variant `bogus`, expected `leak` or `v_post`",
            ),
            (
                "plif_out",
                "3",
                "[model.plif_out]: got integer `3`, expected a string",
            ),
            (
                "lr",
                "\"fast\"",
                "[train.lr]: got string \"fast\", expected a number",
            ),
            (
                "steps",
                "-2",
                "[train.steps]: got integer `-2`, expected a non-negative integer",
            ),
            (
                "steps",
                "\"2\"",
                "[train] steps = \"2\": expected a number, not a string",
            ),
            ("lr", "nan", "[train] lr = NaN: expected a finite number"),
            ("lr", "-inf", "[train] lr = -inf: expected a finite number"),
        ];
        for (key, value, expected) in cases {
            let e = refused(key, value);
            assert!(
                e.contains(expected),
                "`{key} = {value}` gave {e:?}, expected {expected:?}"
            );
            for rust in [
                "Toml",
                "enum ",
                "u64",
                "f64",
                "floating point",
                " for key `",
            ] {
                assert!(!e.contains(rust), "`{key} = {value}` gave {e:?}");
            }
        }
        // config-rs reads `"yes"` as true; a boolean key takes only a boolean.
        let text = DEFAULT_CONFIG.replacen("[train]\n", "[train]\nasync_checkpoint = \"yes\"\n", 1);
        let e = RunConfig::from_str(&text, "test.toml")
            .map(|c| c.train.async_checkpoint)
            .expect_err("taken")
            .to_string();
        assert!(
            e.contains("[train] async_checkpoint = \"yes\": expected `true` or `false`"),
            "{e}"
        );
    }

    /// A value out of range is labelled with its own table: `[model]` or `[train]`.
    #[test]
    fn out_of_range_values_name_their_table() {
        let e = refused("D", "0");
        assert!(
            e.starts_with("config test.toml: [model] ") && e.contains("`D` must be positive"),
            "{e}"
        );
        assert!(!e.contains("[train]"), "{e}");
        let e = refused("lr", "-1");
        assert!(
            e.starts_with("config test.toml: [train] `lr` must be finite and ≥ 0, got -1"),
            "{e}"
        );
    }
}
