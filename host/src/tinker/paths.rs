//! Tinker's checkpoint paths (`tinker://<model id>/<weights|sampler_weights>/<name>`) and
//! the names in them, checked before anything is read or written under the checkpoint
//! root.

/// The parts of a Tinker path, checked: three, none empty, none that leaves the checkpoint
/// root.
pub fn parse_path(path: &str) -> Result<(&str, &str, &str), String> {
    let rest = path.strip_prefix("tinker://").ok_or_else(|| {
        format!(
            "{path:?} is not a Tinker path (tinker://<model id>/<weights|sampler_weights>/<name>)"
        )
    })?;
    let parts: Vec<&str> = rest.split('/').collect();
    let [model, kind, name] = parts[..] else {
        return Err(format!(
            "{path:?} is not a Tinker path (tinker://<model id>/<weights|sampler_weights>/<name>)"
        ));
    };
    if !matches!(kind, "weights" | "sampler_weights") {
        return Err(format!(
            "{path:?}: rlhost keeps `weights` and `sampler_weights` checkpoints, not {kind:?}"
        ));
    }
    for part in [model, name] {
        check_name(part).map_err(|e| format!("{path:?}: {e}"))?;
    }
    Ok((model, kind, name))
}

/// A checkpoint or model name: letters, digits, `.`, `_`, `-`, `:`, not starting with `.`.
pub fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a usable name (letters, digits, `.`, `_`, `-`, `:`; not starting with `.`)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_has_three_parts_and_a_known_kind() {
        assert_eq!(
            parse_path("tinker://m-1/sampler_weights/step:3"),
            Ok(("m-1", "sampler_weights", "step:3"))
        );
        assert_eq!(
            parse_path("tinker://m/weights/w.1"),
            Ok(("m", "weights", "w.1"))
        );
        for bad in [
            "m/weights/w",
            "tinker://m/weights",
            "tinker://m/weights/w/x",
            "tinker://m/optimizer/w",
            "tinker:///weights/w",
        ] {
            assert!(parse_path(bad).is_err(), "{bad}");
        }
    }

    /// Nothing in a path may leave the checkpoint root or name a hidden file.
    #[test]
    fn a_path_cannot_leave_the_checkpoint_root() {
        for bad in [
            "tinker://../weights/w",
            "tinker://m/weights/..",
            "tinker://m/weights/.hidden",
            "tinker://m/weights/a\\b",
            "tinker://m/weights/a b",
            "tinker://m/weights/%2e%2e",
        ] {
            let e = parse_path(bad).unwrap_err();
            assert!(
                e.contains("not a usable name") || e.contains("not a Tinker path"),
                "{bad}: {e}"
            );
        }
        assert!(check_name(&"a".repeat(201)).is_err());
        assert!(check_name(&"a".repeat(200)).is_ok());
    }
}
