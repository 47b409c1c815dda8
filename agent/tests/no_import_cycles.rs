//! No module of the agent imports, directly or through others, a module that imports it: the
//! data flows one way (routing → state → effects → actuators), so no module depends on its caller.
//! Modules are files; `use crate::…` and `super::…` paths (and `crate::` paths in code) are the
//! edges, resolved to the deepest module that exists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src").with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if parts.last().is_some_and(|l| l == "mod") {
                parts.pop();
            }
            if parts == ["lib"] || parts == ["main"] {
                continue;
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

/// The module a path (`a::b::c::Item`) refers to: its longest prefix that is a module.
fn resolve(path: &[&str], known: &BTreeMap<String, PathBuf>) -> Option<String> {
    (1..=path.len()).rev().map(|n| path[..n].join("::")).find(|m| known.contains_key(m))
}

fn edges(module: &str, text: &str, known: &BTreeMap<String, PathBuf>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    // Code after `#[cfg(test)]` is test-only and may use anything.
    let text = text.split("#[cfg(test)]").next().unwrap_or(text);
    let own: Vec<&str> = module.split("::").collect();
    let is_dir = known.get(module).is_some_and(|p| p.ends_with("mod.rs"));
    for (i, _) in text.match_indices("crate::").chain(text.match_indices("super::")) {
        let rest = &text[i..];
        let path: Vec<&str> = rest
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .next()
            .unwrap_or_default()
            .split("::")
            .filter(|s| !s.is_empty())
            .collect();
        let absolute: Vec<&str> = match path.first() {
            Some(&"crate") => path[1..].to_vec(),
            Some(&"super") => {
                // `super` of a file module is its parent; of a `mod.rs`, the grandparent.
                let up = path.iter().take_while(|p| **p == "super").count() + usize::from(is_dir);
                let base = own.len().saturating_sub(up);
                own[..base].iter().copied().chain(path[up - usize::from(is_dir)..].iter().copied()).collect()
            }
            _ => continue,
        };
        if let Some(target) = resolve(&absolute, known)
            && target != module
            && !module.starts_with(&format!("{target}::"))
        {
            out.insert(target);
        }
    }
    out
}

/// Depth-first search for a back edge: the first cycle found, as a path.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_owned());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_owned());
        for next in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

/// Every module of the agent and the modules it imports.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let known = modules(&src);
    assert!(known.contains_key("pod::state") && known.contains_key("pod_router"), "{known:?}");
    let graph: BTreeMap<String, BTreeSet<String>> =
        known.iter().map(|(m, p)| (m.clone(), edges(m, &std::fs::read_to_string(p).expect("read"), &known))).collect();
    assert!(graph["pod_router"].contains("pod::state"), "the checker sees edges: {:?}", graph["pod_router"]);
    graph
}

/// The graph of top-level modules (`pod`, `sidecar`, `effect`, ...): an edge wherever any module
/// inside one imports any module inside another.
fn top_level(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeMap<String, BTreeSet<String>> {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_owned();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, targets) in graph {
        let from = top(m);
        let entry = out.entry(from.clone()).or_default();
        entry.extend(targets.iter().map(|t| top(t)).filter(|t| *t != from));
    }
    out
}

#[test]
fn agent_modules_form_no_import_cycle() {
    let graph = module_graph();
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle: {}", cycle.join(" → "));
    }
    // The checker itself finds a cycle when there is one.
    let mut broken = graph.clone();
    broken.entry("effect".into()).or_default().insert("pod::state".into());
    assert!(find_cycle(&broken).is_some());
}

#[test]
fn top_level_modules_form_no_import_cycle() {
    let graph = top_level(&module_graph());
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle between top-level modules: {}", cycle.join(" → "));
    }
    // Decisions (`pod`) and talking to sidecars (`sidecar`) know nothing of each other, and the
    // effects a decision returns are spoken in leaf words only.
    assert!(!graph["pod"].contains("sidecar") && !graph["sidecar"].contains("pod"), "{graph:?}");
    for dep in &graph["effect"] {
        assert!(graph[dep].is_empty() || dep == "error", "effect imports {dep}, which is no leaf: {:?}", graph[dep]);
    }
    let mut broken = graph.clone();
    broken.entry("vocab".into()).or_default().insert("pod".into());
    broken.entry("pod".into()).or_default().insert("vocab".into());
    assert!(find_cycle(&broken).is_some(), "the checker finds a cycle between top-level modules");
}
