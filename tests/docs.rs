//! The documentation holds together: README is a landing page (at most
//! 300 lines), every relative link in README.md, ARCHITECTURE.md and
//! `docs/` names a file that exists (and, with `#anchor`, a heading it
//! has), and every `docs/design.md §N` the code cites is a section there.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

mod common;

fn repo() -> PathBuf {
    common::repo_path("")
}

/// README.md, ARCHITECTURE.md and every `docs/*.md`.
fn documents() -> Vec<PathBuf> {
    let mut out = vec![repo().join("README.md"), repo().join("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(repo().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation
/// other than `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a markdown file's headings (outside code blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// The targets of `[text](target)` links, outside code blocks and spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn readme_is_a_landing_page() {
    let lines = fs::read_to_string(repo().join("README.md")).unwrap().lines().count();
    assert!(lines <= 300, "README.md has {lines} lines: the reference belongs under docs/");
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    let mut seen = 0;
    for doc in documents() {
        let text = fs::read_to_string(&doc).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            seen += 1;
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() { doc.clone() } else { doc.parent().unwrap().join(path) };
            let name = format!("{}: {link}", doc.strip_prefix(repo()).unwrap().display());
            if !target.exists() {
                broken.push(format!("{name} (no such file)"));
            } else if !anchor.is_empty()
                && target.extension().is_some_and(|e| e == "md")
                && !anchors(&fs::read_to_string(&target).unwrap()).contains(anchor)
            {
                broken.push(format!("{name} (no such heading)"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(seen > 20, "the link scanner sees the links ({seen})");
}

#[test]
fn every_design_section_the_code_cites_exists() {
    let design = fs::read_to_string(repo().join("docs/design.md")).unwrap();
    let sections: BTreeSet<String> = design
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .filter_map(|h| h.split_once('.').map(|(n, _)| n.to_owned()))
        .collect();
    let mut missing = Vec::new();
    let mut cited = 0;
    for path in common::rust_sources() {
        let text = fs::read_to_string(&path).unwrap_or_default();
        for (at, _) in text.match_indices("docs/design.md §") {
            let number: String = text[at + "docs/design.md §".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            cited += 1;
            if !sections.contains(&number) {
                missing.push(format!("{}: §{number}", relative(&path)));
            }
        }
        assert!(!text.contains("DESIGN §"), "{}: cite docs/design.md §N", relative(&path));
    }
    assert!(missing.is_empty(), "sections cited but not in docs/design.md: {missing:?}");
    assert!(cited > 5, "the scanner sees the citations ({cited})");
}

fn relative(path: &Path) -> String {
    path.strip_prefix(repo()).unwrap().display().to_string()
}

#[test]
fn slugs_follow_github() {
    assert_eq!(slug(" What still differs in compat mode"), "what-still-differs-in-compat-mode");
    assert_eq!(
        slug(" 7b. The overload layer (probabilistic drop)"),
        "7b-the-overload-layer-probabilistic-drop"
    );
    assert_eq!(slug(" `envoy.*` keys"), "envoy-keys");
}
