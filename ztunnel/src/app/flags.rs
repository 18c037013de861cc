//! The flag and environment reference in `docs/flags.md`, generated from the binaries'
//! clap definitions so it cannot drift from them (each binary's tests compare it).

use std::fmt::Write;
use std::path::Path;

/// One markdown table of `cmd`'s options: flag, environment variable, default, meaning.
pub fn table(cmd: &clap::Command) -> String {
    // Built, clap fills in what derive leaves implicit (value names, number of values).
    let mut cmd = cmd.clone();
    cmd.build();
    let mut out = String::from("| flag | environment | default | meaning |\n|---|---|---|---|\n");
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if arg.is_hide_set() || matches!(long, "help" | "version") {
            continue;
        }
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = if defaults.is_empty() {
            String::new()
        } else {
            format!("`{}`", defaults.join(","))
        };
        let takes_value = arg.get_num_args().is_some_and(|n| n.takes_values());
        let choices: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|v| v.get_name().to_string())
            .collect();
        let value = if !takes_value {
            String::new()
        } else if !choices.is_empty() {
            format!(" {}", choices.join("\\|"))
        } else {
            let names = arg
                .get_value_names()
                .map(|v| v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" "));
            format!(" {}", names.unwrap_or_else(|| long.to_uppercase()))
        };
        let flag = format!("`--{long}{value}`");
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let help = help
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace('|', "\\|");
        let _ = writeln!(out, "| {flag} | {env} | {default} | {help} |");
    }
    out
}

/// The text of `doc` with the section between `<!-- BEGIN name -->` and `<!-- END name -->`
/// replaced by `body`, or None if the markers are missing.
pub fn with_section(doc: &str, name: &str, body: &str) -> Option<String> {
    let begin = format!("<!-- BEGIN {name} -->\n");
    let end = format!("<!-- END {name} -->");
    let a = doc.find(&begin)? + begin.len();
    let b = a + doc[a..].find(&end)?;
    Some(format!("{}{}{}", &doc[..a], body, &doc[b..]))
}

/// Checks (or, with `UPDATE_DOCS=1`, rewrites) `cmd`'s table in the flag reference;
/// for the binaries' tests. Err says how to regenerate.
pub fn check_reference(doc_path: &Path, name: &str, cmd: &clap::Command) -> Result<(), String> {
    let doc =
        std::fs::read_to_string(doc_path).map_err(|e| format!("{}: {e}", doc_path.display()))?;
    let want = with_section(&doc, name, &table(cmd)).ok_or_else(|| {
        format!(
            "{}: no <!-- BEGIN {name} --> / <!-- END {name} --> markers",
            doc_path.display()
        )
    })?;
    if want == doc {
        return Ok(());
    }
    if std::env::var_os("UPDATE_DOCS").is_some() {
        return std::fs::write(doc_path, want).map_err(|e| format!("{}: {e}", doc_path.display()));
    }
    Err(format!(
        "{} is out of date with {name}'s flags; regenerate it with `UPDATE_DOCS=1 cargo test --workspace --bins flag_reference`",
        doc_path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_row_per_visible_option() {
        let cmd = clap::Command::new("x")
            .arg(
                clap::Arg::new("port")
                    .long("port")
                    .env("X_PORT")
                    .default_value("80")
                    .help("The port | a pipe"),
            )
            .arg(clap::Arg::new("secret").long("secret").hide(true))
            .arg(
                clap::Arg::new("on")
                    .long("on")
                    .action(clap::ArgAction::SetTrue)
                    .help("A switch."),
            );
        let t = table(&cmd);
        assert!(
            t.contains("| `--port PORT` | `X_PORT` | `80` | The port \\| a pipe |"),
            "{t}"
        );
        assert!(t.contains("| `--on` |"), "{t}");
        assert!(!t.contains("secret"), "{t}");
    }

    #[test]
    fn sections_are_replaced_between_their_markers() {
        let doc = "a\n<!-- BEGIN z -->\nold\n<!-- END z -->\nb\n";
        assert_eq!(
            with_section(doc, "z", "new\n").as_deref(),
            Some("a\n<!-- BEGIN z -->\nnew\n<!-- END z -->\nb\n")
        );
        assert_eq!(with_section(doc, "w", "new\n"), None);
    }
}
