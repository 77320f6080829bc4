//! The crate's modules depend on each other one way (docs/architecture.md
//! "Module dependencies"): the worker never on the engine's handle or on the
//! read API, the checkpoint writer never on the worker, and no two modules
//! on each other (the last cycle, between the error type and the run state,
//! ended when parsing a state got its own error, `ParseRunStateError`).
//!
//! Read from the sources: every `crate::<module>` path and every name that
//! `lib.rs` re-exports from one module (`crate::RunState`,
//! `crate::{Engine, ..}`), outside comments.

use std::collections::{BTreeMap, BTreeSet};

/// The names `lib.rs` re-exports from a module of the crate (`pub use
/// module::Name;` and `pub use module::{A, B};`), with that module.
fn reexported_names(src: &str) -> BTreeMap<String, String> {
    let lib = std::fs::read_to_string(format!("{src}/lib.rs")).expect("read lib.rs");
    let mut names = BTreeMap::new();
    for (i, _) in lib.match_indices("\npub use ") {
        let rest = &lib[i + "\npub use ".len()..];
        let statement = &rest[..rest.find(';').expect("the end of a pub use")];
        let Some((module, items)) = statement.split_once("::") else { continue };
        for name in items.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|n| !n.is_empty()) {
            names.insert(name.to_owned(), module.to_owned());
        }
    }
    names
}

/// Each module (a file of `src/`, `store/` as one) with the modules it names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let reexported = reexported_names(src);
    let reexported = |name: &str| reexported.get(name).cloned();
    let mut files = Vec::new();
    for dir in [src.to_owned(), format!("{src}/store")] {
        for entry in std::fs::read_dir(&dir).expect("read src/") {
            let path = entry.expect("a source entry").path();
            if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in &files {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let module = if path.parent().is_some_and(|p| p.ends_with("store")) { "store".to_owned() } else { stem };
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("read a source file");
        let deps = graph.entry(module.clone()).or_default();
        for line in text.lines().map(str::trim).filter(|l| !l.starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let rest = &line[i + "crate::".len()..];
                if rest.starts_with('{') {
                    let list = &rest[1..rest.find('}').unwrap_or(rest.len())];
                    for name in list.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                        deps.extend(reexported(name));
                    }
                    continue;
                }
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                match name.chars().next() {
                    Some(c) if c.is_lowercase() => {
                        deps.insert(name);
                    }
                    Some(_) => deps.extend(reexported(&name)),
                    None => {}
                }
            }
        }
    }
    let known: BTreeSet<String> = graph.keys().cloned().collect();
    for (module, deps) in graph.iter_mut() {
        deps.retain(|d| known.contains(d) && d != module);
    }
    graph
}

/// Every module `from` reaches.
fn reach(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_owned()];
    while let Some(m) = todo.pop() {
        for d in graph.get(&m).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

/// Catches: a module cycle coming back (the worker importing the engine's
/// handle for its shared state, the checkpoint writer importing the
/// worker's supervisor, the context importing the engine to store events),
/// and the worker depending on the read API.
#[test]
fn modules_depend_on_each_other_one_way() {
    let graph = graph();
    for m in ["engine", "worker", "checkpoint", "ctx", "shared", "inspect", "store", "run", "error"] {
        assert!(graph.contains_key(m), "no module {m}: the test reads the wrong sources");
    }
    let worker = reach(&graph, "worker");
    assert!(!worker.contains("engine"), "the worker depends on the engine's handle: {worker:?}");
    assert!(!worker.contains("inspect"), "the worker depends on the read API: {worker:?}");
    assert!(!reach(&graph, "checkpoint").contains("worker"), "the checkpoint writer depends on the worker");
    let cycles: BTreeSet<String> = graph.keys().filter(|m| reach(&graph, m).contains(*m)).cloned().collect();
    assert_eq!(cycles, BTreeSet::new(), "modules on a dependency cycle");
}
