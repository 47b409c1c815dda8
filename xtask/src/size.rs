//! Sizes a reader can hold, for `cargo xtask lint`: no `.rs` file over [`MAX_FILE`] code lines
//! (not blank, not a `//` comment; a `#[cfg(test)] mod tests { … }` is not counted, code after it is) and no
//! function over [`MAX_FN`] lines, signature to closing brace. A function that is a table (a
//! `match` from names to values, a list of rows) may be longer when the line directly above it,
//! or above its attributes, is a comment starting `// table:` that says why.
//!
//! The counter reads lines, not syntax: a function ends at the first `}` alone on a line at the
//! indentation of its `fn` (what rustfmt writes).
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

pub(crate) const MAX_FILE: usize = 600;
pub(crate) const MAX_FN: usize = 80;

/// The crates the lint reads, from the workspace root.
pub(crate) const ROOTS: [&str; 6] = ["agent", "agent-ebpf", "common", "xtask", "tests", "fuzz"];

/// Offenders let stand while a change that shrinks them is under way, as (file, function) with
/// `""` for the file itself: none now. An entry that no longer offends fails the lint too, so the
/// list only shrinks.
pub(crate) const PENDING: &[(&str, &str)] = &[];

/// One thing too big: its file, line (1-based), function (`""` for the file) and size.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Oversize {
    pub(crate) file: String,
    pub(crate) line: usize,
    pub(crate) name: String,
    pub(crate) lines: usize,
}

impl std::fmt::Display for Oversize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.name.is_empty() {
            write!(f, "{}:{}: {} code lines (most {MAX_FILE})", self.file, self.line, self.lines)
        } else {
            let most = format!("most {MAX_FN}, or mark a table `// table: why`");
            write!(f, "{}:{}: fn {} is {} lines ({most})", self.file, self.line, self.name, self.lines)
        }
    }
}

/// What fails the lint under `root`: each offender not in [`PENDING`], and each [`PENDING`] entry
/// that no longer offends (`fixed`).
pub(crate) fn check(root: &Path) -> Result<(Vec<Oversize>, Vec<String>)> {
    let mut found = Vec::new();
    for dir in ROOTS {
        for file in rust_files(&root.join(dir))? {
            let text = std::fs::read_to_string(&file).with_context(|| format!("read {}", file.display()))?;
            let name = file.strip_prefix(root).unwrap_or(&file).display().to_string();
            found.extend(oversize(&name, &text));
        }
    }
    let fixed = PENDING
        .iter()
        .filter(|(file, name)| !found.iter().any(|o| o.file == *file && o.name == *name))
        .map(|(file, name)| if name.is_empty() { file.to_string() } else { format!("{file}: fn {name}") })
        .collect();
    found.retain(|o| !PENDING.contains(&(o.file.as_str(), o.name.as_str())));
    Ok((found, fixed))
}

/// The `.rs` files below `dir`, build output (`target/`) and hidden directories left out.
fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    if !dir.is_dir() {
        return Ok(files);
    }
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                files.extend(rust_files(&path)?);
            }
        } else if name.ends_with(".rs") {
            files.push(path);
        }
    }
    Ok(files)
}

/// The file (if over [`MAX_FILE`] code lines) and the functions over [`MAX_FN`] lines of one
/// source text, not marked as tables.
pub(crate) fn oversize(file: &str, text: &str) -> Vec<Oversize> {
    let lines: Vec<&str> = text.lines().collect();
    let tests = test_modules(&lines);
    let code = (0..lines.len())
        .filter(|i| !tests.iter().any(|r| r.contains(i)))
        .filter(|&i| {
            let l = lines[i].trim();
            !l.is_empty() && !l.starts_with("//")
        })
        .count();
    let mut found = Vec::new();
    if code > MAX_FILE {
        found.push(Oversize { file: file.into(), line: 1, name: String::new(), lines: code });
    }
    for (i, line) in lines.iter().enumerate() {
        let Some((indent, name)) = fn_start(line) else { continue };
        let close = format!("{indent}}}");
        let Some(end) = (i..lines.len()).find(|&j| lines[j].trim_end() == close) else { continue };
        let n = end - i + 1;
        if n > MAX_FN && !is_table(&lines, i) {
            found.push(Oversize { file: file.into(), line: i + 1, name: name.into(), lines: n });
        }
    }
    found
}

/// The line ranges of the top-level test modules: a `#[cfg(test)]` at column 0 followed by a
/// module with a body, through the first `}` at column 0 after it (what rustfmt writes). Code
/// after the module counts.
fn test_modules(lines: &[&str]) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_end() == "#[cfg(test)]" {
            let mut j = i + 1;
            while j < lines.len() && lines[j].starts_with("#[") {
                j += 1;
            }
            let item = lines.get(j).copied().unwrap_or("");
            let item = item.trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            if item.starts_with("mod ") && item.trim_end().ends_with('{') {
                let end = (j..lines.len()).find(|&k| lines[k].trim_end() == "}").unwrap_or(lines.len() - 1);
                ranges.push(i..end + 1);
                i = end;
            }
        }
        i += 1;
    }
    ranges
}

/// A function's indentation and name when `line` starts one with a body (not a trait's
/// declaration ending in `;`).
fn fn_start(line: &str) -> Option<(&str, &str)> {
    let rest = line.trim_start();
    let indent = &line[..line.len() - rest.len()];
    let mut words = rest;
    for prefix in ["pub(crate) ", "pub(super) ", "pub ", "async ", "const ", "unsafe ", "extern \"C\" "] {
        // Qualifiers come in this order (`pub(crate) const unsafe fn`).
        words = words.strip_prefix(prefix).unwrap_or(words);
    }
    let after = words.strip_prefix("fn ")?;
    let name: &str = &after[..after.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(after.len())];
    if name.is_empty() || line.trim_end().ends_with(';') {
        return None;
    }
    Some((indent, name))
}

/// Whether the function starting at line `at` is marked as a table: a `// table:` comment on the
/// line directly above it or above its attributes and doc comments.
fn is_table(lines: &[&str], at: usize) -> bool {
    let mut i = at;
    while i > 0 {
        i -= 1;
        let l = lines[i].trim();
        if l.starts_with("// table:") {
            return true;
        }
        if !(l.starts_with("#[") || l.starts_with("///")) {
            return false;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn function(name: &str, body_lines: usize) -> String {
        let body: String = (0..body_lines).map(|k| format!("    let _x{k} = {k};\n")).collect();
        format!("fn {name}() {{\n{body}}}\n")
    }

    #[test]
    fn a_function_over_the_limit_fails_and_one_at_it_passes() {
        let text = format!("{}\n{}", function("short", MAX_FN - 2), function("long", MAX_FN - 1));
        let found = oversize("a.rs", &text);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].name, "long");
        assert_eq!(found[0].line, MAX_FN + 2);
        assert_eq!(found[0].lines, MAX_FN + 1);
    }

    #[test]
    fn a_method_is_counted_at_its_own_indentation() {
        let body: String = (0..MAX_FN).map(|k| format!("        let _x{k} = {k};\n")).collect();
        let text = format!("impl A {{\n    pub(crate) async fn m(&self) {{\n{body}    }}\n}}\n");
        let found = oversize("a.rs", &text);
        assert_eq!(found.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), ["m"]);
    }

    #[test]
    fn a_marked_table_passes_directly_above_or_above_its_attributes() {
        let long = function("names", MAX_FN);
        assert!(oversize("a.rs", &format!("// table: one row per name\n{long}")).is_empty());
        let attrs = "// table: one row per name\n/// Names.\n#[must_use]\n";
        assert!(oversize("a.rs", &format!("{attrs}{long}")).is_empty());
        // Not directly above: a blank line or other code between counts as unmarked.
        assert_eq!(oversize("a.rs", &format!("// table: rows\n\n{long}")).len(), 1);
        assert_eq!(oversize("a.rs", &format!("// a table of rows\n{long}")).len(), 1);
    }

    #[test]
    fn the_test_module_is_not_counted_in_the_file() {
        let code: String = (0..MAX_FILE).map(|k| format!("const C{k}: u8 = 0;\n// comment\n\n")).collect();
        let tests: String = (0..50).map(|k| format!("    const T{k}: u8 = 0;\n")).collect();
        let text = format!("{code}#[cfg(test)]\nmod tests {{\n{tests}}}\n");
        assert!(oversize("a.rs", &text).is_empty());
        let after = oversize("a.rs", &format!("{text}const AFTER: u8 = 0;\n"));
        assert_eq!(after.len(), 1, "code after the test module counts: {after:?}");
        let found = oversize("a.rs", &format!("{code}const ONE_MORE: u8 = 0;\n"));
        assert_eq!(found, [Oversize { file: "a.rs".into(), line: 1, name: String::new(), lines: MAX_FILE + 1 }]);
    }

    #[test]
    fn a_long_test_function_still_fails() {
        let body: String = (0..MAX_FN).map(|k| format!("        let _x{k} = {k};\n")).collect();
        let text = format!("#[cfg(test)]\nmod tests {{\n    fn t() {{\n{body}    }}\n}}\n");
        assert_eq!(oversize("a.rs", &text).len(), 1);
    }
}
