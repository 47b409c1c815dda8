//! The compatibility table (docs/compatibility.md), checked against the matrix the qemu suites run: every
//! kernel, cgroup mode, runtime and layout the table says was verified is one the suites boot,
//! and every one they boot is in the table.
#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use crate::node::{Cgroups, matrix};

    /// docs/compatibility.md's first table: first column → the other columns' text.
    fn table() -> Vec<(String, String)> {
        let page = crate::cmd::workspace_root().join("docs/compatibility.md");
        let text = std::fs::read_to_string(&page).expect("docs/compatibility.md");
        let section = text.split("# Compatibility\n").nth(1).expect("a Compatibility section");
        section
            .lines()
            .take_while(|l| !l.starts_with("## "))
            .filter(|l| l.starts_with('|') && !l.starts_with("|---") && !l.starts_with("| |"))
            .filter_map(|l| {
                let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
                Some((cells.first()?.to_string(), cells[1..].join(" | ")))
            })
            .collect()
    }

    fn row(name: &str) -> String {
        table().into_iter().find(|(k, _)| k == name).map(|(_, v)| v).unwrap_or_else(|| panic!("no row {name:?}"))
    }

    /// Dotted version numbers (`5.10`, `6.1`) in a text.
    fn versions(text: &str) -> BTreeSet<String> {
        text.split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .map(|w| w.trim_matches('.'))
            .filter(|w| w.contains('.') && w.split('.').all(|p| !p.is_empty()))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn the_kernels_row_names_the_kernels_the_suites_boot() {
        let kernel = row("kernel");
        let named = versions(kernel.split(" | ").nth(1).expect("a verified column"));
        let booted: BTreeSet<String> = crate::kernels::MATRIX.iter().map(|(_, v)| v.to_string()).collect();
        // The host's own kernel is named too (the host suites run on it); every other version
        // named must be one the kernel matrix boots, and every one it boots is named.
        let host: BTreeSet<String> = named.difference(&booted).cloned().collect();
        assert!(host.len() <= 1, "kernels named but never booted: {host:?} (docs/compatibility.md: {kernel})");
        assert!(booted.is_subset(&named), "kernels booted but not named: {booted:?} (docs/compatibility.md: {kernel})");
    }

    #[test]
    fn the_cgroups_runtime_and_layout_rows_name_the_node_matrix() {
        let cells = matrix();
        let cgroups = row("cgroups");
        for (mode, name) in [(Cgroups::V2, "v2"), (Cgroups::V1, "v1"), (Cgroups::Hybrid, "hybrid")] {
            let run = cells.iter().any(|c| c.cgroups == mode);
            let verified = cgroups.split(" | ").nth(1).expect("a verified column").contains(name);
            assert_eq!(
                run, verified,
                "cgroup mode {name}: in the node matrix {run}, in docs/compatibility.md {verified}"
            );
        }
        let runtime = row("runtime");
        for r in cells.iter().map(|c| c.runtime).collect::<BTreeSet<_>>() {
            assert!(
                runtime.contains(r),
                "runtime {r} runs in the node matrix but docs/compatibility.md does not name it"
            );
        }
        let layout = row("layout");
        for l in cells.iter().map(|c| c.layout).collect::<BTreeSet<_>>() {
            assert!(
                layout.contains(l),
                "layout {l} runs in the node matrix but docs/compatibility.md does not name it"
            );
        }
    }

    #[test]
    fn versions_are_read_from_text() {
        let v = versions("Debian's 5.10, 6.1, 6.12 in qemu; 6.18.");
        assert_eq!(v, ["5.10", "6.1", "6.12", "6.18"].map(String::from).into());
    }
}
