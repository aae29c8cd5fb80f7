//! What a component file is and what it offers: the checks that run before a plugin is
//! instantiated, so that a wrong file gets one clear line instead of a linker error.

use super::bindings::{PACKAGE, SUPPORTED};
use super::types::Role;
use std::collections::BTreeSet;
use std::path::Path;
use wasmtime::Engine;
use wasmtime::component::Component;

/// Why a file cannot be loaded as a plugin. Each message names the file and says how to
/// fix it.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The OS error is in the message, and so not the error's `source`: a chain printed
    /// whole (`{:#}`) would say it twice.
    #[error("cannot read plugin {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error(
        "{path} is not a WebAssembly file (it starts with {start}); build the plugin for wasm32-wasip2"
    )]
    NotWasm { path: String, start: String },
    #[error(
        "{path} is a core WebAssembly module, not a component; build it with `cargo build --target wasm32-wasip2` (or wrap it with `wasm-tools component new`)"
    )]
    CoreModule { path: String },
    #[error("{path} is not a valid component: {message}")]
    Invalid { path: String, message: String },
    #[error(
        "{path} was built for {PACKAGE}@{found}, but this rlhost supports {PACKAGE}@{supported}; rebuild the plugin against wit/v{newest} (or use an rlhost that supports {found})",
        supported = SUPPORTED.join(", "),
        newest = SUPPORTED[0]
    )]
    WrongVersion { path: String, found: String },
    #[error(
        "{path} exports no rlhost role (trigger, environment, dataset or reward); its exports are: {exports}"
    )]
    NoRole { path: String, exports: String },
    #[error(
        "{path} does not export {PACKAGE}/about@{version}, which every plugin must; with the Rust SDK use `rlhost_sdk::export!`, in Python define `class About`"
    )]
    NoAbout { path: String, version: String },
    #[error(
        "{path} imports `{import}`, which rlhost does not provide to plugins (it provides WASI 0.2 and {PACKAGE}/host)"
    )]
    UnknownImport { path: String, import: String },
    #[error("plugin `{plugin}` ({path}) exports {exported}, not {wanted}")]
    MissingRole {
        plugin: String,
        path: String,
        wanted: Role,
        exported: String,
    },
}

/// The outline of a plugin component, read from its type without running it.
#[derive(Debug, Clone)]
pub struct Shape {
    /// The `rlhost:plugin` version the component was built against.
    pub wit_version: String,
    /// The roles it exports, in [`Role`] order.
    pub roles: Vec<Role>,
    /// Every import name, e.g. `wasi:cli/stdout@0.2.6`.
    pub imports: Vec<String>,
    /// Every export name.
    pub exports: Vec<String>,
}

/// Reads a plugin file, telling apart the usual mistakes before compiling.
pub fn read_wasm(path: &Path) -> Result<Vec<u8>, LoadError> {
    let display = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|error| LoadError::Read {
        path: display.clone(),
        error,
    })?;
    if !bytes.starts_with(b"\0asm") {
        let start = bytes
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(" ");
        let start = if start.is_empty() {
            "nothing: the file is empty".to_string()
        } else {
            start
        };
        return Err(LoadError::NotWasm {
            path: display,
            start,
        });
    }
    // Bytes 4..8 are the version and layer: 01 00 00 00 for a core module, a layer of 1
    // (bytes 6..8 = 01 00) for a component.
    if bytes.get(4..8) == Some(&[1, 0, 0, 0]) {
        return Err(LoadError::CoreModule { path: display });
    }
    Ok(bytes)
}

/// Splits `rlhost:plugin/trigger@0.1.0` into (`trigger`, `0.1.0`).
fn our_interface(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix(PACKAGE)?.strip_prefix('/')?;
    rest.split_once('@')
}

/// Reads the roles, version and imports from a compiled component's type.
pub fn shape(path: &Path, engine: &Engine, component: &Component) -> Result<Shape, LoadError> {
    let display = path.display().to_string();
    let ty = component.component_type();
    let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
    let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_string()).collect();

    let versions: BTreeSet<&str> = exports
        .iter()
        .chain(&imports)
        .filter_map(|n| our_interface(n))
        .map(|(_, version)| version)
        .collect();
    if let Some(found) = versions.iter().find(|v| !SUPPORTED.contains(v)) {
        return Err(LoadError::WrongVersion {
            path: display,
            found: found.to_string(),
        });
    }
    let wit_version = versions
        .first()
        .copied()
        .unwrap_or(SUPPORTED[0])
        .to_string();

    let exported: BTreeSet<&str> = exports
        .iter()
        .filter_map(|n| our_interface(n))
        .map(|(iface, _)| iface)
        .collect();
    let roles: Vec<Role> = Role::ALL
        .into_iter()
        .filter(|r| exported.contains(r.interface()))
        .collect();
    if roles.is_empty() {
        return Err(LoadError::NoRole {
            path: display,
            exports: if exports.is_empty() {
                "none".into()
            } else {
                exports.join(", ")
            },
        });
    }
    if !exported.contains("about") {
        return Err(LoadError::NoAbout {
            path: display,
            version: wit_version,
        });
    }
    // The interfaces the host provides to plugins of this version (`model` from 0.2.0).
    let provided: Vec<String> = ["host", "types", "model"]
        .iter()
        .filter(|i| **i != "model" || wit_version != "0.1.0")
        .map(|i| format!("{PACKAGE}/{i}@{wit_version}"))
        .collect();
    if let Some(import) = imports
        .iter()
        .find(|n| !n.starts_with("wasi:") && !provided.contains(n))
    {
        return Err(LoadError::UnknownImport {
            path: display,
            import: import.clone(),
        });
    }
    Ok(Shape {
        wit_version,
        roles,
        imports,
        exports,
    })
}

/// Lists roles as `trigger, reward`.
pub fn role_list(roles: &[Role]) -> String {
    roles
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_our_interface_names_only() {
        assert_eq!(
            our_interface("rlhost:plugin/trigger@0.1.0"),
            Some(("trigger", "0.1.0"))
        );
        assert_eq!(our_interface("wasi:cli/stdout@0.2.6"), None);
        assert_eq!(our_interface("rlhost:pluginx/trigger@0.1.0"), None);
    }

    #[test]
    fn tells_text_core_modules_and_empty_files_apart() {
        let dir = std::env::temp_dir().join(format!("rlhost-inspect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = dir.join("text.wasm");
        std::fs::write(&text, "hello").unwrap();
        let err = read_wasm(&text).unwrap_err().to_string();
        assert!(err.contains("is not a WebAssembly file"), "{err}");
        let empty = dir.join("empty.wasm");
        std::fs::write(&empty, "").unwrap();
        let err = read_wasm(&empty).unwrap_err().to_string();
        assert!(err.contains("the file is empty"), "{err}");
        // Issue 51: the OS error's text once in the line the CLI prints, not twice.
        let missing = anyhow::Error::new(read_wasm(&dir.join("missing.wasm")).unwrap_err());
        let line = format!("{missing:#}");
        assert_eq!(line.matches("(os error 2)").count(), 1, "{line}");
        let core = dir.join("core.wasm");
        std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
        let err = read_wasm(&core).unwrap_err().to_string();
        assert!(
            err.contains("core WebAssembly module, not a component"),
            "{err}"
        );
        let missing = dir.join("missing.wasm");
        let err = read_wasm(&missing).unwrap_err().to_string();
        assert!(err.starts_with("cannot read plugin"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
