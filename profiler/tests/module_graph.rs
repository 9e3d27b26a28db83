//! The shape of the workspace's source, checked: no import circles between
//! the top-level modules of profiler, symbolizer, flamegraphs and xtask (a
//! module's `crate::NAME` uses, its tests left out), no function over 150
//! lines and no file over 800 lines outside tests.

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
    ["#[cfg(test)]\nmod tests", "#[cfg(test)]\npub(crate) mod tests"]
        .iter()
        .filter_map(|m| text.find(m))
        .min()
        .map_or(text, |i| &text[..i])
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

/// The import circles between the top-level modules of the crate whose
/// source is `src`, each as `a -> b -> ... -> a`.
fn circles(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let m = module_of(src, f);
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
    circles
}

/// The workspace's crates whose module graph is kept without circles.
const CRATES: [&str; 4] = ["profiler/src", "symbolizer/src", "flamegraphs/src", "xtask/src"];

#[test]
fn no_import_circles_between_top_level_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for krate in CRATES {
        let found = circles(&root.join(krate));
        assert!(found.is_empty(), "import circles in {krate}: {found:#?}");
    }
}

#[test]
fn a_planted_circle_is_found() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("b")).unwrap();
    std::fs::write(dir.join("main.rs"), "mod a;\nmod b;\nfn main() { a::f(); }\n").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::b::g;\npub fn f() { g() }\n").unwrap();
    std::fs::write(dir.join("b/mod.rs"), "mod inner;\npub fn g() {}\n").unwrap();
    std::fs::write(dir.join("b/inner.rs"), "pub fn h() { crate::a::f() }\n").unwrap();
    let found = circles(dir);
    assert!(found.iter().any(|c| c == "a -> b -> a"), "{found:?}");
}

#[test]
fn crate_uses_reads_paths_and_groups() {
    let text = "use crate::{aggregate::{A, B}, detectors::{self, X}, slots};\nlet x = crate::topology::f();";
    let got: Vec<String> = crate_uses(text).into_iter().collect();
    assert_eq!(got, ["aggregate", "detectors", "slots", "topology"]);
}

/// Functions longer than `limit` lines in the Rust files under `dir`
/// (their unit-test modules left out): (lines, file, name).
fn long_functions(dir: &Path, limit: usize) -> Vec<(usize, String, String)> {
    let mut files = Vec::new();
    sources(dir, &mut files);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = without_tests(&text).lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let indent = line.len() - line.trim_start().len();
            let mut words = line.split_whitespace();
            let mut w = words.next();
            while let Some(q) = w.filter(|q| q.starts_with("pub") || ["const", "async", "unsafe"].contains(q))
            {
                let _ = q;
                w = words.next();
            }
            if w != Some("fn") {
                continue;
            }
            let name: String = words
                .next()
                .unwrap_or("")
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let close = format!("{}}}", " ".repeat(indent));
            if let Some(j) = lines[i + 1..].iter().position(|l| *l == close) {
                if j + 2 > limit {
                    out.push((j + 2, f.display().to_string(), name));
                }
            }
        }
    }
    out
}

/// The repository's code outside tests (the `tests` crate of stall
/// programs, fuzz targets and every unit-test module excluded): no
/// function over 150 lines.
#[test]
fn no_function_over_150_lines_outside_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut long = Vec::new();
    for dir in CODE {
        long.extend(long_functions(&root.join(dir), 150));
    }
    assert!(long.is_empty(), "functions over 150 lines: {long:#?}");
}

/// The code the shape rules hold for: everything but the `tests` crate
/// (stall programs and end-to-end tests) and the fuzz targets.
const CODE: [&str; 5] = [
    "profiler/src",
    "profiler-ebpf/src",
    "symbolizer/src",
    "flamegraphs/src",
    "xtask/src",
];

/// Rust files under `dir` longer than `limit` lines before their unit-test
/// module: (lines, file).
fn long_files(dir: &Path, limit: usize) -> Vec<(usize, String)> {
    let mut files = Vec::new();
    sources(dir, &mut files);
    files
        .into_iter()
        .filter_map(|f| {
            let text = std::fs::read_to_string(&f).unwrap();
            let n = without_tests(&text).lines().count();
            (n > limit).then(|| (n, f.display().to_string()))
        })
        .collect()
}

/// No file of the code over 800 lines outside its unit tests: a file that
/// long holds more than one thing, and is split where its parts meet.
#[test]
fn no_file_over_800_lines_outside_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut long = Vec::new();
    for dir in CODE {
        long.extend(long_files(&root.join(dir), 800));
    }
    assert!(long.is_empty(), "files over 800 lines: {long:#?}");
}

#[test]
fn a_planted_long_file_is_found_and_its_tests_do_not_count() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let code = "pub fn f() {}\n".repeat(801);
    std::fs::write(dir.join("long.rs"), &code).unwrap();
    let tests = "fn t() {}\n".repeat(2000);
    std::fs::write(
        dir.join("short.rs"),
        format!("pub fn f() {{}}\n#[cfg(test)]\nmod tests {{\n{tests}}}\n"),
    )
    .unwrap();
    let got = long_files(dir, 800);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].0, 801);
    assert!(got[0].1.ends_with("long.rs"), "{got:?}");
}

#[test]
fn long_functions_are_measured_from_fn_to_its_closing_brace() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let body = "    let x = 1;\n".repeat(160);
    std::fs::write(
        dir.join("a.rs"),
        format!("pub(crate) async fn long() {{\n{body}}}\n\nfn short() {{\n}}\n"),
    )
    .unwrap();
    let got = long_functions(dir, 150);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].0, got[0].2.as_str()), (162, "long"));
}
