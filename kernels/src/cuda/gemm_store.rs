//! The batch-invariant decoding GEMMs' picks ([`crate::cuda::gemm_invariant`]) and the tuned
//! training projections' (`Plan::tune_or_stored`, keys beginning `v1 train `) kept on disk
//! beside the kernel caches, `<cache dir>/gemm/invariant-picks.tsv` (the name from before the
//! training picks joined): a restart, or a process started later on the host, takes them
//! instead of timing again, so the same request gives the same logits after a restart or in a
//! later replica, and a run's first step does not time its projections again. (Two processes
//! that time the same problem at once may keep different picks; the one written last stays in
//! the file.)
//!
//! One line per problem: its key (a format version, device name, cuBLASLt version, problem), a
//! tab, and the algorithm's eight 64-bit words in hex. cuBLASLt's algorithm structures may be
//! stored and reused with the same library version; the key holds the version, and a stored
//! pick is used only where cuBLASLt confirms it still runs the problem at every probe size and
//! it does not reduce in place. A line that does not parse is dropped with a warning (the file
//! is rewritten without it, and its problem is timed again). A new pick is merged into the file
//! as it is on disk then (it replaces its problem's line, which was missing or unusable; other
//! processes' lines for other problems stay), written to a temporary file and renamed over it. Without a cache directory (`[backend] cache_dir` unset) the picks
//! live in memory only.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// An algorithm's words, as `cublasLtMatmulAlgo_t` holds them.
pub(crate) type Words = [u64; 8];

/// The file under the cache directory.
const FILE: &str = "gemm/invariant-picks.tsv";

struct Store {
    path: Option<PathBuf>,
    picks: HashMap<String, Words>,
}

static STORE: Mutex<Option<Store>> = Mutex::new(None);

fn with_store<R>(f: impl FnOnce(&mut Store) -> R) -> R {
    let mut guard = STORE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let store = guard.get_or_insert_with(|| {
        let path = crate::cuda::cache::dir().map(|d| d.join(FILE));
        let picks = path.as_deref().map(load).unwrap_or_default();
        if let Some(p) = path.as_deref().filter(|_| !picks.is_empty()) {
            eprintln!(
                "nsactor: {} stored GEMM pick(s) from {}",
                picks.len(),
                p.display()
            );
        }
        Store { path, picks }
    });
    f(store)
}

/// The stored pick of the problem `key`, if any.
pub(crate) fn lookup(key: &str) -> Option<Words> {
    with_store(|s| s.picks.get(key).copied())
}

/// Keeps `words` as the pick of `key`, and rewrites the file where there is one (a failure to
/// write is a warning: the pick still holds for this process).
pub(crate) fn record(key: &str, words: Words) {
    with_store(|s| {
        s.picks.insert(key.to_string(), words);
        let Some(path) = &s.path else { return };
        if let Err(e) = merge_into(path, &s.picks, key) {
            eprintln!(
                "nsactor: warning: the GEMM picks cannot be written to {}: {e}",
                path.display()
            );
        }
    });
}

/// Writes `picks` into the file at `path` as it is on disk now: `newest` (just timed, because
/// no usable line was there) replaces the file's line; for other problems what other processes
/// stored since this one read the file stays, theirs first.
fn merge_into(path: &Path, picks: &HashMap<String, Words>, newest: &str) -> std::io::Result<()> {
    let mut merged = load(path);
    for (k, w) in picks {
        if k == newest {
            merged.insert(k.clone(), *w);
        } else {
            merged.entry(k.clone()).or_insert(*w);
        }
    }
    save(path, &merged)
}

fn load(path: &Path) -> HashMap<String, Words> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HashMap::new(),
        Err(e) => {
            eprintln!(
                "nsactor: warning: the batch-invariant GEMM picks in {} cannot be read ({e}); timing them again",
                path.display()
            );
            return HashMap::new();
        }
    };
    let (picks, bad) = parse(&text);
    if bad > 0 {
        eprintln!(
            "nsactor: warning: {bad} line(s) of {} do not parse and were dropped; those problems are timed again",
            path.display()
        );
        if let Err(e) = save(path, &picks) {
            eprintln!(
                "nsactor: warning: {} cannot be rewritten without them: {e}",
                path.display()
            );
        }
    }
    picks
}

fn save(path: &Path, picks: &HashMap<String, Words>) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tsv.{}", std::process::id()));
    std::fs::write(&tmp, format(picks))?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The picks of `text` and how many non-empty lines did not parse.
pub(crate) fn parse(text: &str) -> (HashMap<String, Words>, usize) {
    let mut picks = HashMap::new();
    let mut bad = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match parse_line(line) {
            Some((key, words)) => {
                picks.insert(key.to_string(), words);
            }
            None => bad += 1,
        }
    }
    (picks, bad)
}

fn parse_line(line: &str) -> Option<(&str, Words)> {
    let (key, rest) = line.split_once('\t')?;
    let mut words = [0u64; 8];
    let mut parts = rest.split_whitespace();
    for w in &mut words {
        *w = u64::from_str_radix(parts.next()?, 16).ok()?;
    }
    (parts.next().is_none() && !key.is_empty()).then_some((key, words))
}

/// The file's text: one line per pick, sorted by key.
pub(crate) fn format(picks: &HashMap<String, Words>) -> String {
    let mut keys: Vec<&String> = picks.keys().collect();
    keys.sort();
    let mut out = String::new();
    for k in keys {
        let words: Vec<String> = picks[k].iter().map(|w| format!("{w:x}")).collect();
        out.push_str(&format!("{k}\t{}\n", words.join(" ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_round_trip_through_the_file_format() {
        let mut picks = HashMap::new();
        picks.insert(
            "H100 lt130000 n=896".to_string(),
            [1, 2, 3, 4, 5, 6, 7, u64::MAX],
        );
        picks.insert(
            "H100 lt130000 n=30464".to_string(),
            [0x1b00000042, 0, 0, 0, 0, 0, 0, 9],
        );
        let text = format(&picks);
        assert_eq!(text.lines().count(), 2);
        assert!(text.starts_with("H100 lt130000 n=30464\t1b00000042 0 "));
        assert_eq!(parse(&text), (picks, 0));
    }

    #[test]
    fn lines_that_do_not_parse_are_skipped_and_counted() {
        let good = "k\t1 2 3 4 5 6 7 8";
        let text = [
            good,
            "no tab here 1 2 3 4 5 6 7 8",
            "short\t1 2 3",
            "long\t1 2 3 4 5 6 7 8 9",
            "nothex\t1 2 3 4 5 6 7 zz",
            "\t1 2 3 4 5 6 7 8",
            "",
        ]
        .join("\n");
        let (picks, bad) = parse(&text);
        assert_eq!(bad, 5);
        assert_eq!(picks.len(), 1);
        assert_eq!(picks["k"], [1, 2, 3, 4, 5, 6, 7, 8]);
    }

    #[test]
    fn a_saved_file_loads_back_and_a_corrupt_one_loads_what_parses() {
        let dir = std::env::temp_dir().join(format!("nsactor-gemm-store-{}", std::process::id()));
        let path = dir.join(FILE);
        let mut picks = HashMap::new();
        picks.insert("a".to_string(), [9; 8]);
        save(&path, &picks).unwrap();
        assert_eq!(load(&path), picks);
        std::fs::write(&path, "a\t9 9 9 9 9 9 9 9\ngarbage\n").unwrap();
        assert_eq!(load(&path), picks);
        // The corrupt line is gone from the file once read.
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "a\t9 9 9 9 9 9 9 9\n"
        );
        // A new pick merged in replaces its problem's line and keeps what another process
        // stored for other problems meanwhile ("a" is also in ours, with other words).
        let on_disk_before = "a\t1 1 1 1 1 1 1 1\nb\t2 2 2 2 2 2 2 2\nc\t4 4 4 4 4 4 4 4\n";
        std::fs::write(&path, on_disk_before).unwrap();
        let mut ours = picks.clone();
        ours.insert("c".to_string(), [3; 8]);
        merge_into(&path, &ours, "c").unwrap();
        let on_disk = load(&path);
        assert_eq!(on_disk.len(), 3);
        assert_eq!(
            (on_disk["a"], on_disk["b"], on_disk["c"]),
            ([1; 8], [2; 8], [3; 8])
        );
        // A missing file is an empty store, not an error.
        assert!(load(&dir.join("missing.tsv")).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
