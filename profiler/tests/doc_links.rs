//! Every relative link in README.md, BENCHMARKS.md, MUTANTS.md and docs/
//! leads somewhere: its file exists and, with a `#fragment`, the file has
//! a heading of that anchor (GitHub's rule: lower case, punctuation but
//! `-` and `_` dropped, spaces as `-`). Links inside code are not links.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The markdown files checked.
fn documents() -> Vec<PathBuf> {
    let r = root();
    let mut v: Vec<PathBuf> = ["README.md", "BENCHMARKS.md", "MUTANTS.md"]
        .iter()
        .map(|f| r.join(f))
        .collect();
    for e in std::fs::read_dir(r.join("docs"))
        .expect("docs/ is there")
        .flatten()
    {
        if e.path().extension().is_some_and(|x| x == "md") {
            v.push(e.path());
        }
    }
    v
}

/// A heading's anchor, as GitHub makes it.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The text outside fenced code blocks and inline code spans.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Inline code: every other piece between backticks.
        for (i, piece) in line.split('`').enumerate() {
            if i % 2 == 0 {
                out.push_str(piece);
            }
        }
        out.push('\n');
    }
    out
}

/// The anchors of a markdown file's headings.
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut v = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            v.push(anchor(line.trim_start_matches('#')));
        }
    }
    v
}

/// `](target)` link targets in `text`'s prose.
fn links(text: &str) -> Vec<String> {
    let p = prose(text);
    let mut v = Vec::new();
    let mut rest = p.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            v.push(rest[..end].trim().to_string());
            rest = &rest[end..];
        }
    }
    v
}

/// What is wrong with the links of `doc` (whose text is `text`).
fn broken(doc: &Path, text: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for link in links(text) {
        if link.contains("://") || link.starts_with("mailto:") {
            continue;
        }
        let (path, fragment) = match link.split_once('#') {
            Some((p, f)) => (p, Some(f)),
            None => (link.as_str(), None),
        };
        let target = if path.is_empty() {
            doc.to_path_buf()
        } else {
            doc.parent().unwrap().join(path)
        };
        if !target.exists() {
            bad.push(format!("{}: {link}: no {}", doc.display(), target.display()));
            continue;
        }
        if let Some(f) = fragment {
            let t = if path.is_empty() {
                text.to_string()
            } else {
                std::fs::read_to_string(&target).unwrap_or_default()
            };
            if !anchors(&t).iter().any(|a| a == f) {
                bad.push(format!(
                    "{}: {link}: no heading #{f} in {}",
                    doc.display(),
                    target.display()
                ));
            }
        }
    }
    bad
}

#[test]
fn every_relative_link_in_the_readme_and_docs_leads_somewhere() {
    let docs = documents();
    assert!(docs.len() >= 5, "{docs:?}");
    let mut bad = Vec::new();
    let mut followed = 0;
    for d in &docs {
        let text = std::fs::read_to_string(d).unwrap();
        followed += links(&text).len();
        bad.extend(broken(d, &text));
    }
    assert!(
        followed >= 10,
        "only {followed} links found: is the link reader broken?"
    );
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

#[test]
fn the_link_check_fails_on_a_planted_broken_link_and_ignores_code() {
    let doc = root().join("docs/user-guide.md");
    let text = "# Top\n\n## Two words: `here`\n\n[ok](#two-words-here) [ok](../README.md)\n\
                [bad](nowhere.md) [bad anchor](#nope) [web](https://example.com)\n\
                `[code](not-a-link.md)`\n```\n[fenced](not-either.md)\n```\n";
    let bad = broken(&doc, text);
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(
        bad[0].contains("nowhere.md") && bad[1].contains("#nope"),
        "{bad:?}"
    );
}

#[test]
fn the_readme_fits_on_a_few_screens() {
    let n = std::fs::read_to_string(root().join("README.md"))
        .unwrap()
        .lines()
        .count();
    assert!(
        n <= 250,
        "README.md has {n} lines (at most 250: the rest belongs in docs/)"
    );
}
