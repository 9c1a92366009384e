//! Corpora as the ecosystem hands them over, through the `nsactor` binary: a folder of Parquet
//! shards laid out as `datasets` and the Hub write them (several files, snappy and zstd, the
//! text in a column not named `text`) and a `.jsonl.zst` file of the same rows, prepared into
//! shards by `nsactor data prepare` and trained on for two steps; a missing column is refused,
//! naming the columns there are. A corpus whose read blocks (a FIFO nobody writes) leaves the
//! run stoppable at once.

mod common;

use common::cli::{nsactor, run_err, run_ok, temp_dir, trains_two_steps_on};
use nsactor_data::parquet_docs::StringsWriter;
use std::time::{Duration, Instant};

fn manifest(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn parquet_folders_and_zst_files_prepare_and_train() {
    let dir = temp_dir("corpora");
    let p = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let corpus = nsactor_data::bundled_corpus();
    let rows: Vec<&str> = nsactor_data::corpus::paragraphs(&corpus)
        .take(600)
        .collect();

    // ds/data/train-0000N-of-00003.parquet, 200 rows each in row groups of 64, beside the
    // metadata a dataset folder holds.
    let data = dir.join("ds/data");
    std::fs::create_dir_all(&data).unwrap();
    for (n, codec) in ["snappy", "zstd", "snappy"].iter().enumerate() {
        let path = data.join(format!("train-{n:05}-of-00003.parquet"));
        let mut w = StringsWriter::create(&path, "content", codec).unwrap();
        let part: Vec<Option<&str>> = rows[200 * n..200 * (n + 1)]
            .iter()
            .map(|r| Some(*r))
            .collect();
        for g in part.chunks(64) {
            w.write_group(g).unwrap();
        }
        w.close().unwrap();
    }
    std::fs::write(dir.join("ds/README.md"), "---\nlicense: cc0\n---\n").unwrap();
    std::fs::write(dir.join("ds/dataset_info.json"), "{}").unwrap();
    let jsonl: String = rows
        .iter()
        .map(|r| serde_json::json!({ "text": r }).to_string() + "\n")
        .collect();
    let zst = zstd::stream::encode_all(jsonl.as_bytes(), 3).unwrap();
    std::fs::write(p("rows.jsonl.zst"), zst).unwrap();

    let log = run_ok(&[
        "data",
        "prepare",
        "--out",
        &p("pq"),
        "--text-column",
        "content",
        &p("ds"),
    ]);
    assert!(
        log.contains("600 documents") && log.contains("MB/s of files"),
        "{log}"
    );
    let m = manifest(&dir.join("pq"));
    let sources: Vec<&str> = m["sources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        sources.len(),
        3,
        "the three shards, not the metadata: {sources:?}"
    );
    assert!(
        sources[2].ends_with("ds/data/train-00002-of-00003.parquet"),
        "{sources:?}"
    );

    let log = run_ok(&["data", "prepare", "--out", &p("zst"), &p("rows.jsonl.zst")]);
    assert!(log.contains("600 documents"), "{log}");
    let z = manifest(&dir.join("zst"));
    assert_eq!(
        z["shards"], m["shards"],
        "the same rows make the same shards"
    );

    // The default column is `text`: refused, naming the file and the columns it has.
    let e = run_err(&["data", "prepare", "--out", &p("none"), &p("ds")]);
    assert!(
        e.contains("train-00000-of-00003.parquet: no column `text`")
            && e.contains("`content` (string)"),
        "{e}"
    );
    assert!(!dir.join("none/manifest.json").exists());

    // Two steps on the Parquet shards; and on the .zst file read straight into memory.
    trains_two_steps_on(&p("pq"), &p("run"));
    let log = run_ok(&[
        "train",
        "--steps",
        "2",
        "--corpus",
        &p("rows.jsonl.zst"),
        "--out",
        &p("run2"),
    ]);
    assert!(dir.join("run2/model.safetensors").exists(), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A signal before the first step (here while the corpus read blocks on a FIFO nobody
/// writes) exits at once with 143: there is nothing to finish or save, and the grace period
/// would only be waited out.
#[test]
fn sigterm_before_the_first_step_exits_at_once() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = temp_dir("sigterm-early");
    let fifo = dir.join("corpus.txt");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) on a path this test owns.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let mut child = nsactor()
        .args([
            "train",
            "--steps",
            "4",
            "--corpus",
            fifo.to_str().unwrap(),
            "--out",
        ])
        .arg(dir.join("run"))
        .env("NSACTOR_TRAIN__SHUTDOWN_GRACE_S", "600")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A writer opens without blocking once the run has opened the FIFO to read (after its
    // signal handlers are in place); held open and silent, the run's read then blocks.
    let t = Instant::now();
    let _writer = loop {
        let w = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo);
        match w {
            Ok(w) => break w,
            Err(_) => {
                assert!(child.try_wait().unwrap().is_none(), "the run ended");
                assert!(t.elapsed() < Duration::from_secs(60), "the run never read");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    // SAFETY: kill(2) on the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(143), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        stderr.contains("SIGTERM: exiting at once, while starting"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
