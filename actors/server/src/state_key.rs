//! The key that signs state files ([`crate::saved`]). A state file's membranes go into the
//! prefix cache that every client's requests start from, so a server trusts only files signed
//! with its key (HMAC-SHA256): a client cannot forge the state after tokens it never ran and
//! hand it to other clients. Servers that exchange state files (a conversation taken to
//! another server, or back after a restart) share one key: `$NSACTOR_STATE_KEY`, or a key file
//! (`nsactor serve --state-key-file`, by default `$XDG_CONFIG_HOME/nsactor/state-key`, else
//! `~/.config/nsactor/state-key`, made with a random key on first use, readable by its owner
//! only).

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The signing key (32 bytes, never printed).
#[derive(Clone, PartialEq, Eq)]
pub struct StateKey([u8; 32]);

impl std::fmt::Debug for StateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateKey(..)")
    }
}

impl Default for StateKey {
    /// [`StateKey::process`].
    fn default() -> Self {
        StateKey::process()
    }
}

impl StateKey {
    /// The key of a secret of any length (an environment variable's, a key file's text).
    pub fn from_secret(secret: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(b"nsactor state key\0");
        h.update(secret);
        StateKey(h.finalize().into())
    }

    /// This process's own key, drawn at random once: its servers trust each other's files,
    /// no other process does (what `generate`, the benchmarks and tests run with).
    pub fn process() -> Self {
        static KEY: OnceLock<StateKey> = OnceLock::new();
        KEY.get_or_init(|| StateKey::from_secret(&random_secret()))
            .clone()
    }

    /// The key in `path`, made there (a random secret, mode 0600) when there is none yet. Two
    /// servers making it at once end with one key: the file appears whole or not at all.
    pub fn load_or_create(path: &Path) -> Result<Self, String> {
        match std::fs::read(path) {
            Ok(text) => return Self::of_file(path, &text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(format!(
                    "cannot read the state key file {}: {e}",
                    path.display()
                ));
            }
        }
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {} for the state key: {e}", dir.display()))?;
        let tmp = dir.join(format!(".state-key.{}.tmp", std::process::id()));
        let written = (|| {
            let mut f = private_file(&tmp)?;
            f.write_all(&random_secret())?;
            f.write_all(b"\n")?;
            f.sync_all()?;
            // Published whole, and only if no other server published one first.
            match std::fs::hard_link(&tmp, path) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e),
                _ => Ok(()),
            }
        })();
        let _ = std::fs::remove_file(&tmp);
        written.map_err(|e| format!("cannot write the state key file {}: {e}", path.display()))?;
        let text = std::fs::read(path)
            .map_err(|e| format!("cannot read the state key file {}: {e}", path.display()))?;
        Self::of_file(path, &text)
    }

    fn of_file(path: &Path, text: &[u8]) -> Result<Self, String> {
        let secret = text.trim_ascii();
        if secret.len() < 16 {
            return Err(format!(
                "the state key file {} holds {} bytes; a key is at least 16",
                path.display(),
                secret.len()
            ));
        }
        Ok(StateKey::from_secret(secret))
    }

    /// Where the key file is by default: `$XDG_CONFIG_HOME/nsactor/state-key`, else
    /// `~/.config/nsactor/state-key`; `None` without either variable.
    pub fn default_path() -> Option<PathBuf> {
        std::env::var_os("XDG_CONFIG_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
            .map(|c| c.join("nsactor").join("state-key"))
    }

    /// The signature of `bytes`.
    pub fn sign(&self, bytes: &[u8]) -> [u8; 32] {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(bytes);
        m.finalize().into_bytes().into()
    }

    /// Whether `tag` is the signature of `bytes` (compared in constant time).
    pub fn verify(&self, bytes: &[u8], tag: &[u8]) -> bool {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(bytes);
        m.verify_slice(tag).is_ok()
    }
}

/// 32 random bytes as 64 hex characters (a key file's text).
fn random_secret() -> Vec<u8> {
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).expect("the operating system's random source");
    raw.iter()
        .flat_map(|b| format!("{b:02x}").into_bytes())
        .collect()
}

/// A new file only its owner may read.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    o.open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_is_made_once_and_read_back() {
        let dir = std::env::temp_dir().join(format!("nsactor-state-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("sub").join("state-key");
        let a = StateKey::load_or_create(&path).unwrap();
        let b = StateKey::load_or_create(&path).unwrap();
        assert_eq!(a, b);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // Signatures: the key's own verify, another key's not, a changed byte not.
        let tag = a.sign(b"membranes");
        assert!(a.verify(b"membranes", &tag));
        assert!(!StateKey::from_secret(b"another secret, long").verify(b"membranes", &tag));
        assert!(!a.verify(b"membranez", &tag));
        // A short key file is refused, saying so.
        std::fs::write(&path, "short\n").unwrap();
        let e = StateKey::load_or_create(&path).unwrap_err();
        assert!(e.contains("a key is at least 16"), "{e}");
        assert_eq!(format!("{a:?}"), "StateKey(..)");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
