//! The handbook (`docs/`, an mdBook) and the README: every relative link resolves to a
//! file, every `#anchor` to a heading of that file (mdBook's and GitHub's ids), every
//! `{{#include}}` to a file, and every page is in `SUMMARY.md`. CI also builds the book
//! with `mdbook build docs`.

use rlhost_tests::repo_root;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The ids mdBook gives a page's headings: the text lowercased, whitespace as `-`, other
/// punctuation than `-` and `_` dropped; a repeated id gets `-1`, `-2`, ….
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut in_code = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let text = line.trim_start_matches('#').trim();
        let text = strip_links(text);
        let id: String = text
            .chars()
            .filter_map(|c| {
                if c.is_alphanumeric() || c == '_' || c == '-' {
                    Some(c.to_lowercase().next().unwrap())
                } else if c.is_whitespace() {
                    Some('-')
                } else {
                    None
                }
            })
            .collect();
        let mut unique = id.clone();
        let mut n = 1;
        while seen.contains(&unique) {
            unique = format!("{id}-{n}");
            n += 1;
        }
        seen.insert(unique);
    }
    seen
}

/// `[text](target)` as `text`.
fn strip_links(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find("](").and_then(|close| {
            let end = after[close..].find(')')? + close;
            Some((close, end))
        }) {
            Some((close, end)) => {
                out.push_str(&after[..close]);
                rest = &after[end + 1..];
            }
            None => {
                out.push('[');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The link targets of a page, outside code blocks and inline code.
fn links(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // Drop inline code spans: `[a](b)` in backticks is not a link.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(
                after[..end]
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .to_string(),
            );
            rest = &after[end..];
        }
    }
    out
}

fn pages() -> Vec<PathBuf> {
    let mut pages = vec![repo_root().join("README.md")];
    let src = repo_root().join("docs/src");
    let mut book: Vec<PathBuf> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    book.sort();
    pages.extend(book);
    pages
}

#[test]
fn every_link_of_the_book_and_the_readme_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        for target in links(&text) {
            if target.is_empty()
                || target.starts_with("http://")
                || target.starts_with("https://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            checked += 1;
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let resolved: PathBuf = if file.is_empty() {
                page.clone()
            } else {
                dir.join(file)
            };
            if !resolved.exists() {
                broken.push(format!("{}: {target}: no such file", name(&page)));
                continue;
            }
            if let Some(anchor) = anchor
                && resolved.extension().is_some_and(|e| e == "md")
            {
                let ids = anchors(&std::fs::read_to_string(&resolved).unwrap());
                if !ids.contains(anchor) {
                    broken.push(format!(
                        "{}: {target}: no heading with that id",
                        name(&page)
                    ));
                }
            }
        }
        for include in text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("{{#include "))
        {
            let file = include.trim_end_matches("}}").trim();
            if !dir.join(file).exists() {
                broken.push(format!("{}: include {file}: no such file", name(&page)));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "{} broken of {checked} links:\n{}",
        broken.len(),
        broken.join("\n")
    );
    assert!(checked > 50, "{checked}");
}

#[test]
fn every_page_is_in_the_summary() {
    let src = repo_root().join("docs/src");
    let summary = std::fs::read_to_string(src.join("SUMMARY.md")).unwrap();
    let listed: BTreeSet<String> = links(&summary).into_iter().collect();
    for page in pages().iter().skip(1) {
        let file = page.file_name().unwrap().to_str().unwrap();
        // The summary itself, and the generated reference the configuration page includes.
        if file == "SUMMARY.md" || file == "config-reference.md" {
            continue;
        }
        assert!(
            listed.contains(file),
            "{file} is not in docs/src/SUMMARY.md"
        );
    }
}

fn name(page: &Path) -> String {
    page.strip_prefix(repo_root())
        .unwrap_or(page)
        .display()
        .to_string()
}

#[test]
fn anchors_follow_mdbooks_rule() {
    let ids = anchors(
        "# Set up and run\n## The `cases` key (per case)\n## Set up and run\n```\n# not a heading\n```\n## [Linked](x.md) text",
    );
    let want: BTreeSet<String> = [
        "set-up-and-run",
        "the-cases-key-per-case",
        "set-up-and-run-1",
        "linked-text",
    ]
    .into_iter()
    .map(str::to_string)
    .collect();
    assert_eq!(ids, want);
}
