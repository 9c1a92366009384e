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
