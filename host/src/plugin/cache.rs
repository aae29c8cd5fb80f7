//! On-disk cache of compiled components.
//!
//! Compiling a component is slow (3–8 s for a Python one); loading a precompiled artifact
//! takes milliseconds. An artifact only loads under the same wasmtime version and engine
//! `Config`, so the key is the component's sha256 plus a hash of the engine's
//! compatibility fingerprint. Each file ends with the sha256 of what precedes it: a
//! truncated or corrupt entry is detected before wasmtime maps it, and recompiled.

use sha2::{Digest, Sha256};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Where compiled components are kept.
pub struct ComponentCache {
    dir: PathBuf,
    engine_key: String,
}

/// The default cache directory: `$RLHOST_CACHE_DIR`, else `$XDG_CACHE_HOME/rlhost`, else
/// `$HOME/.cache/rlhost`; `None` if none of them is set.
pub fn default_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("RLHOST_CACHE_DIR") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("rlhost"));
    }
    var("HOME").map(|home| PathBuf::from(home).join(".cache").join("rlhost"))
}

impl ComponentCache {
    pub fn new(root: &Path, engine: &Engine) -> Self {
        // DefaultHasher is only stable within one build of std; a different hash after a
        // toolchain upgrade merely misses the cache. wasmtime checks compatibility again
        // when deserializing, so a stale entry can never load as a wrong one.
        let mut hasher = DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        ComponentCache {
            dir: root.join("components"),
            engine_key: format!("{:016x}", hasher.finish()),
        }
    }

    fn path(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}-{}.cwasm", self.engine_key))
    }

    /// Loads the compiled form of the component with this sha256, or compiles `wasm`
    /// and stores it. Returns the component and whether it came from the cache.
    pub fn load_or_compile(
        &self,
        engine: &Engine,
        wasm: &[u8],
        sha256: &str,
    ) -> wasmtime::Result<(Component, bool)> {
        let path = self.path(sha256);
        if let Ok(bytes) = std::fs::read(&path) {
            match verified(&bytes) {
                // SAFETY: `deserialize` trusts its input to be wasmtime's own output. These
                // bytes are a file this cache wrote, and the checksum just matched, so they
                // are what `serialize` produced.
                Some(artifact) => match unsafe { Component::deserialize(engine, artifact) } {
                    Ok(component) => return Ok((component, true)),
                    Err(e) => tracing::warn!(
                        "cached component {} does not load ({e}); recompiling",
                        path.display()
                    ),
                },
                None => tracing::warn!(
                    "cached component {} is corrupt; recompiling",
                    path.display()
                ),
            }
        }
        let component = Component::new(engine, wasm)?;
        if let Err(e) = self.store(&path, &component) {
            tracing::warn!(
                "cannot cache compiled component at {}: {e:#}",
                path.display()
            );
        }
        Ok((component, false))
    }

    /// Writes the artifact atomically: a temporary file in the same directory, renamed
    /// into place, so a reader never sees half a file.
    fn store(&self, path: &Path, component: &Component) -> anyhow::Result<()> {
        let mut bytes = component.serialize().map_err(|e| anyhow::anyhow!("{e}"))?;
        let digest = Sha256::digest(&bytes);
        bytes.extend_from_slice(&digest);
        std::fs::create_dir_all(&self.dir)?;
        // Unique per process and call: two threads compiling the same plugin must not
        // write the same temporary file.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    }
}

/// The artifact without its checksum trailer, if the trailer matches.
fn verified(bytes: &[u8]) -> Option<&[u8]> {
    let split = bytes.len().checked_sub(32)?;
    let (artifact, digest) = bytes.split_at(split);
    (Sha256::digest(artifact).as_slice() == digest).then_some(artifact)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_trailer_rejects_any_change() {
        let mut file = b"artifact".to_vec();
        file.extend_from_slice(&Sha256::digest(b"artifact"));
        assert_eq!(verified(&file), Some(&b"artifact"[..]));
        file[0] ^= 1;
        assert_eq!(verified(&file), None);
        assert_eq!(verified(&file[..10]), None);
        assert_eq!(verified(b""), None);
    }
}
