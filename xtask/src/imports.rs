//! The import graph of one crate's modules, for `cargo xtask lint`: a module imports another when
//! it names it or an item in it through a `crate::`, `super::`, `self::` or child-module path (in
//! `use` items, in code, and in macro arguments). A module's own inline modules (its tests) count
//! as the module.
//!
//! The modules stand in floors: siblings (the modules one module declares) may import each other
//! only one way round. An import from `a::b` into `c::d` is one of `a` into `c`, siblings below
//! the crate root; one from `p::x` into `p::y` is one of `x` into `y`, siblings below `p`. A
//! module's imports of its own ancestors (a child's `super::Report`) and descendants (a parent's
//! `state::PodState`) are the inside of one sibling and take no part. A circle is a set of
//! siblings that import each other round: none of them can be read, tested or moved without the
//! others.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// A module's path below the crate root (`[]` for the root itself).
type Module = Vec<String>;

/// One import between siblings: the one that imports, the one it reaches, and the import that
/// says so (its modules and path).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Edge {
    from: Module,
    to: Module,
    why: String,
}

/// The import circles among the modules of the crate whose sources are under `src` (its root
/// `lib.rs`, else `main.rs`): for each group of siblings that import each other round, one
/// shortest circle through it, an import a line (`a -> c (a::b -> c::d: crate::c::d::Item)`).
/// Empty when there is none.
pub(crate) fn circles(src: &Path) -> Result<Vec<Vec<String>>> {
    let files = module_files(src)?;
    let modules: BTreeSet<Module> = files.keys().cloned().collect();
    let mut edges = BTreeSet::new();
    for (module, file) in &files {
        let text = std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
        let ast = syn::parse_file(&text).with_context(|| format!("parse {}", file.display()))?;
        let mut paths = Paths { scope: module.clone(), found: Vec::new() };
        paths.visit_file(&ast);
        for (scope, path) in paths.found {
            let Some(to) = resolve(&modules, &scope, &path) else { continue };
            // Below their deepest common ancestor, the two siblings that hold them.
            let common = module.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == module.len() || common == to.len() {
                continue;
            }
            let why = format!("{} -> {}: {}", name(module), name(&to), path.join("::"));
            edges.insert(Edge { from: module[..=common].to_vec(), to: to[..=common].to_vec(), why });
        }
    }
    Ok(strongly_connected(&modules, &edges).iter().map(|group| shortest_circle(group, &edges)).collect())
}

/// One shortest circle through a group of siblings that import each other round, as its imports
/// (each with the first import that makes it), so that the lint names a path to cut rather than
/// the whole group.
fn shortest_circle(group: &BTreeSet<Module>, edges: &BTreeSet<Edge>) -> Vec<String> {
    let inside: Vec<&Edge> = edges.iter().filter(|e| group.contains(&e.from) && group.contains(&e.to)).collect();
    let mut best: Option<Vec<&Edge>> = None;
    for start in group {
        // Breadth first from `start` back to it: each module's edge in.
        let mut came: BTreeMap<&Module, &Edge> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        'walk: while let Some(at) = queue.pop_front() {
            for e in inside.iter().filter(|e| &e.from == at) {
                if came.contains_key(&e.to) {
                    continue;
                }
                came.insert(&e.to, e);
                if &e.to == start {
                    break 'walk;
                }
                queue.push_back(&e.to);
            }
        }
        let Some(mut e) = came.get(start).copied() else { continue };
        let mut circle = vec![e];
        while &e.from != start {
            e = came[&e.from];
            circle.push(e);
        }
        circle.reverse();
        if best.as_ref().is_none_or(|b| circle.len() < b.len()) {
            best = Some(circle);
        }
    }
    best.unwrap_or_default().iter().map(|e| format!("{} -> {} ({})", name(&e.from), name(&e.to), e.why)).collect()
}

fn name(module: &Module) -> String {
    if module.is_empty() { "crate".into() } else { module.join("::") }
}

/// Every module file below `src`, by module path: `a/b.rs` and `a/b/mod.rs` are `a::b`. A crate
/// with a `lib.rs` is read as the library: its `main.rs` (a binary of its own, importing the
/// library by name) and `bin/` are left out.
fn module_files(src: &Path) -> Result<BTreeMap<Module, PathBuf>> {
    let library = src.join("lib.rs").exists();
    let mut files = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
            let path = entry?.path();
            let rel = path.strip_prefix(src)?.to_path_buf();
            if path.is_dir() {
                if !(library && rel == Path::new("bin")) {
                    stack.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let mut module: Module =
                rel.with_extension("").iter().map(|part| part.to_string_lossy().into_owned()).collect();
            match module.last().map(String::as_str) {
                Some("mod") => {
                    module.pop();
                }
                Some("lib") if module.len() == 1 => module.clear(),
                Some("main") if module.len() == 1 && !library => module.clear(),
                Some("main") if module.len() == 1 => continue,
                _ => {}
            }
            files.insert(module, path);
        }
    }
    Ok(files)
}

/// The paths a file names, each with the (inline) module it is named in.
struct Paths {
    scope: Module,
    found: Vec<(Module, Vec<String>)>,
}

impl Paths {
    fn add(&mut self, path: Vec<String>) {
        if !path.is_empty() {
            self.found.push((self.scope.clone(), path));
        }
    }

    /// Paths in a macro's tokens (`format!("{}", crate::a::B)`): `crate`, `super` or `self`
    /// followed by `::`-separated names.
    fn tokens(&mut self, tokens: TokenStream) {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < trees.len() {
            match &trees[i] {
                TokenTree::Group(group) => self.tokens(group.stream()),
                TokenTree::Ident(ident) if ["crate", "super", "self"].contains(&ident.to_string().as_str()) => {
                    let mut path = vec![ident.to_string()];
                    while let (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)), Some(TokenTree::Ident(next))) =
                        (trees.get(i + 1), trees.get(i + 2), trees.get(i + 3))
                        && a.as_char() == ':'
                        && b.as_char() == ':'
                    {
                        path.push(next.to_string());
                        i += 3;
                    }
                    if path.len() > 1 {
                        self.add(path);
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }
}

/// The paths of a `use` tree, each whole (`a::{b, c::d}` is `a::b` and `a::c::d`).
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => out.push([prefix.as_slice(), &[n.ident.to_string()]].concat()),
        syn::UseTree::Rename(r) => out.push([prefix.as_slice(), &[r.ident.to_string()]].concat()),
        syn::UseTree::Glob(_) => out.push(prefix.clone()),
        syn::UseTree::Group(g) => {
            for tree in &g.items {
                use_paths(tree, prefix, out);
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut out = Vec::new();
        use_paths(&item.tree, &mut Vec::new(), &mut out);
        for path in out {
            self.add(path);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.add(path.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
        syn::visit::visit_macro(self, mac);
    }

    /// `pub(crate)`, `pub(super)`: a visibility imports nothing.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.scope.push(item.ident.to_string());
        syn::visit::visit_item_mod(self, item);
        self.scope.pop();
    }
}

/// The module file a path named in `scope` reaches (the longest module prefix of the path), or
/// `None` for a path outside the crate (another crate, a local item, a prelude name).
fn resolve(modules: &BTreeSet<Module>, scope: &Module, path: &[String]) -> Option<Module> {
    let mut at: Module = match path.first()?.as_str() {
        "crate" => Vec::new(),
        "self" | "super" => scope.clone(),
        // A child module's item (`state::PodState`); a lone name is a local one.
        first if path.len() > 1 => {
            let child = [scope.as_slice(), &[first.to_string()]].concat();
            if !modules.contains(&child) {
                return None;
            }
            scope.clone()
        }
        _ => return None,
    };
    let mut rest = &path[usize::from(path[0] == "crate" || path[0] == "self")..];
    while rest.first().is_some_and(|s| s == "super") {
        at.pop()?;
        rest = &rest[1..];
    }
    let mut reached = None;
    for part in rest {
        at.push(part.clone());
        if !modules.contains(&at) {
            break;
        }
        reached = Some(at.clone());
    }
    // A path to an item of a module (or of an inline module of it): the nearest module file.
    let reached = reached.unwrap_or_else(|| {
        let mut base = at.clone();
        while !modules.contains(&base) && base.pop().is_some() {}
        base
    });
    Some(reached)
}

/// The groups of two or more modules that import each other round (Tarjan's strongly connected
/// components).
fn strongly_connected(modules: &BTreeSet<Module>, edges: &BTreeSet<Edge>) -> Vec<BTreeSet<Module>> {
    let index: BTreeMap<&Module, usize> = modules.iter().enumerate().map(|(i, m)| (m, i)).collect();
    let nodes: Vec<&Module> = modules.iter().collect();
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for e in edges {
        if let (Some(&a), Some(&b)) = (index.get(&e.from), index.get(&e.to)) {
            next[a].push(b);
        }
    }
    struct Walk<'a> {
        next: &'a [Vec<usize>],
        order: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: Vec<bool>,
        count: usize,
        groups: Vec<Vec<usize>>,
    }
    fn visit(w: &mut Walk<'_>, v: usize) {
        w.order[v] = Some(w.count);
        w.low[v] = w.count;
        w.count += 1;
        w.stack.push(v);
        w.on_stack[v] = true;
        for &n in &w.next[v] {
            match w.order[n] {
                None => {
                    visit(w, n);
                    w.low[v] = w.low[v].min(w.low[n]);
                }
                Some(o) if w.on_stack[n] => w.low[v] = w.low[v].min(o),
                Some(_) => {}
            }
        }
        if Some(w.low[v]) == w.order[v] {
            let mut group = Vec::new();
            while let Some(n) = w.stack.pop() {
                w.on_stack[n] = false;
                group.push(n);
                if n == v {
                    break;
                }
            }
            w.groups.push(group);
        }
    }
    let mut w = Walk {
        next: &next,
        order: vec![None; nodes.len()],
        low: vec![0; nodes.len()],
        stack: Vec::new(),
        on_stack: vec![false; nodes.len()],
        count: 0,
        groups: Vec::new(),
    };
    for v in 0..nodes.len() {
        if w.order[v].is_none() {
            visit(&mut w, v);
        }
    }
    w.groups.into_iter().filter(|g| g.len() > 1).map(|g| g.into_iter().map(|i| nodes[i].clone()).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The circles of a crate of its own, written to a scratch directory: `files` as (path below
    /// src, text).
    fn circles_of(name: &str, files: &[(&str, &str)]) -> Result<Vec<Vec<String>>> {
        let src = std::env::temp_dir().join(format!("valet-imports-{name}-{}", std::process::id()));
        if src.exists() {
            std::fs::remove_dir_all(&src)?;
        }
        for (path, text) in files {
            let file = src.join(path);
            std::fs::create_dir_all(file.parent().unwrap_or(&src))?;
            std::fs::write(file, text)?;
        }
        let found = circles(&src);
        std::fs::remove_dir_all(&src)?;
        found
    }

    #[test]
    fn finds_a_circle_through_use_code_and_macros() -> Result<()> {
        let found = circles_of(
            "circle",
            &[
                ("lib.rs", "pub mod a; pub mod b; pub mod c; pub mod low;"),
                ("a.rs", "use crate::b::{self, B};\nuse crate::low::L;"),
                ("b/mod.rs", "pub mod inner; pub struct B; fn f() { let _ = crate::c::C; }"),
                ("b/inner.rs", "use super::B;"),
                ("c.rs", "pub struct C; fn g() { println!(\"{:?}\", crate::a::A); }"),
                ("low.rs", "pub struct L; #[cfg(test)] mod tests { use super::*; use std::io; }"),
            ],
        )?;
        assert_eq!(
            found,
            [vec![
                "a -> b (a -> b: crate::b::B)".to_string(),
                "b -> c (b -> c: crate::c::C)".into(),
                "c -> a (c -> a: crate::a::A)".into(),
            ]],
            "one circle a, b, c; b::inner's import of its parent and low's tests are none"
        );
        Ok(())
    }

    #[test]
    fn the_agent_and_xtask_stand_in_floors() -> Result<()> {
        let root = crate::cmd::workspace_root();
        for src in ["agent/src", "xtask/src"] {
            assert_eq!(circles(&root.join(src))?, Vec::<Vec<String>>::new(), "{src}");
        }
        Ok(())
    }

    #[test]
    fn a_tree_of_floors_has_none() -> Result<()> {
        let found = circles_of(
            "floors",
            &[
                ("main.rs", "mod a; mod b; use a::A; fn main() {}"),
                ("a.rs", "pub struct A; use crate::b::B; mod t { use super::super::b; }"),
                ("b.rs", "pub struct B; use std::fmt;"),
            ],
        )?;
        assert!(found.is_empty(), "{found:?}");
        Ok(())
    }
}
