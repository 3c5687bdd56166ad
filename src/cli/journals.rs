//! `rotary journals …` and `rotary fragments`: journals' specs (apply,
//! list, edit, delete), their spools and heads (seal, reset-head), and
//! their fragments (list, prune).
//!
//! Specs travel as YAML with the revision each was read at, so that `apply`
//! of an edited list changes only what nobody changed meanwhile.

use super::broker::{connect, BrokerArgs};
use super::exit::{after_change, print_json, print_text, CliError, CmdResult};
use super::TableOrJson;
use crate::output;
use anyhow::Context as _;
use clap::{Subcommand, ValueEnum};
use rotary_net::client::Client;
use rotary_net::spec::{parse_specs, LabelSelector};

#[derive(Subcommand, Debug)]
pub(super) enum JournalsCmd {
    /// Creates or replaces journals from YAML or JSON specs (one spec or a list).
    Apply {
        /// Spec file; `-` reads standard input.
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Lists journals. `-o yaml` prints a list of specs, each with the
    /// revision it was read at, that `apply` takes back (refusing a spec
    /// changed meanwhile); `-o json` prints the broker's entries (spec,
    /// revision and route).
    List {
        /// Label selector, e.g. `app=orders,region notin (eu, us),!retired`.
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = ListFormat::Table)]
        output: ListFormat,
        /// Keep listing: print a line for each journal whose spec or route
        /// changes (and each that appears or goes), until interrupted.
        #[arg(long = "watch", conflicts_with = "output")]
        watch: bool,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Opens the specs of the selected journals in `$EDITOR` (as `list -o
    /// yaml` prints them) and applies what is saved: a spec changed by
    /// someone else meanwhile is refused with ETCD_TRANSACTION_FAILED.
    Edit {
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Deletes a journal and its local fragments.
    Delete {
        name: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Seals a journal's open spool into a fragment now.
    Seal {
        name: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Moves a journal's write head to the end of its history in the
    /// fragment stores. Needed once after a broker lost its data directory
    /// (appends answer INDEX_HAS_GREATER_OFFSET until then). Prints
    /// `{"journal":…,"write_head":…}`.
    ResetHead {
        name: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Deletes store fragments older than their journal's
    /// `fragment.retention` (journals whose retention is 0s keep everything),
    /// and, whatever their age, those the journal's brokers found
    /// conflicting with its committed history (`rotary fragments` shows
    /// them). Prints one line per fragment removed.
    Prune {
        /// Only journals matching this label selector.
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
        /// Print what would be removed, remove nothing.
        #[arg(long = "dry-run")]
        dry_run: bool,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
        output: TableOrJson,
        #[command(flatten)]
        broker: BrokerArgs,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(super) enum ListFormat {
    Table,
    Json,
    Yaml,
}

pub(super) async fn journals(cmd: JournalsCmd) -> CmdResult {
    match cmd {
        JournalsCmd::Apply { file, broker } => apply(&file, &broker).await,
        JournalsCmd::List {
            selector,
            watch,
            broker,
            ..
        } if watch => {
            check_selector(&selector)?;
            let client = connect(&broker).await?;
            watch_journals(&client, &selector).await
        }
        JournalsCmd::Edit { selector, broker } => {
            check_selector(&selector)?;
            let client = connect(&broker).await?;
            edit_journals(&client, &selector).await
        }
        JournalsCmd::List {
            selector,
            output,
            broker,
            ..
        } => list(&selector, output, &broker).await,
        JournalsCmd::Delete { name, broker } => delete(&name, &broker).await,
        JournalsCmd::Seal { name, broker } => seal(&name, &broker).await,
        JournalsCmd::ResetHead { name, broker } => reset_head(name, &broker).await,
        JournalsCmd::Prune {
            selector,
            dry_run,
            output,
            broker,
        } => prune(&selector, dry_run, output, &broker).await,
    }
}

/// A selector the broker would refuse is bad input, found before connecting.
fn check_selector(selector: &str) -> CmdResult {
    LabelSelector::parse_journals(selector)
        .map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
    Ok(())
}

/// `journals apply`: the specs of a file (or standard input), each checked
/// against the revision it carries, if any.
async fn apply(file: &str, broker: &BrokerArgs) -> CmdResult {
    let text = if file == "-" {
        std::io::read_to_string(std::io::stdin())
            .map_err(|e| CliError::Usage("BAD_USAGE", format!("reading standard input: {e}")))?
    } else {
        std::fs::read_to_string(file)
            .map_err(|e| CliError::Usage("BAD_USAGE", format!("reading {file}: {e}")))?
    };
    let (text, revisions) = take_revisions(&text)?;
    let specs = parse_specs(&text).map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
    let client = connect(broker).await?;
    let applied = if revisions.iter().all(Option::is_none) {
        client.apply(&specs).await?
    } else {
        let revised: Vec<_> = specs.iter().cloned().zip(revisions).collect();
        client.apply_revised(&revised).await?
    };
    let text = format!("applied {applied} journal(s): {}", name_list(&specs));
    after_change(print_text(&format!("{text}\n")), || text)
}

async fn list(selector: &str, output: ListFormat, broker: &BrokerArgs) -> CmdResult {
    check_selector(selector)?;
    let client = connect(broker).await?;
    let list = client.list(selector).await?;
    match output {
        ListFormat::Json => print_json(&list),
        ListFormat::Yaml => print_text(&revised_yaml(list)?),
        ListFormat::Table => print_text(&output::journals_table(&list)),
    }
}

async fn delete(name: &str, broker: &BrokerArgs) -> CmdResult {
    let client = connect(broker).await?;
    client.delete(name).await?;
    after_change(print_text(&format!("deleted {name}\n")), || {
        format!("deleted {name}")
    })
}

async fn seal(name: &str, broker: &BrokerArgs) -> CmdResult {
    let client = connect(broker).await?;
    let sealed = client.seal(name).await?;
    let line = serde_json::json!({ "sealed": sealed });
    after_change(print_json(&line), || format!("sealed: {line}"))
}

async fn reset_head(name: String, broker: &BrokerArgs) -> CmdResult {
    let client = connect(broker).await?;
    let write_head = client.reset_head(&name).await?;
    let line = serde_json::json!({ "journal": name, "write_head": write_head });
    after_change(print_text(&format!("{line}\n")), || {
        format!("reset the head: {line}")
    })
}

/// `journals prune`: a line per fragment (to be) removed, and their count
/// on stderr under a table.
async fn prune(
    selector: &str,
    dry_run: bool,
    output: TableOrJson,
    broker: &BrokerArgs,
) -> CmdResult {
    check_selector(selector)?;
    let client = connect(broker).await?;
    let pruned = client.prune(selector, dry_run).await?;
    let verb = if dry_run { "would prune" } else { "pruned" };
    let printed = match output {
        TableOrJson::Json => print_json(&pruned),
        TableOrJson::Table => print_text(&output::pruned_lines(&pruned, dry_run)),
    };
    let printed = match dry_run {
        true => printed,
        false => after_change(printed, || format!("pruned {} fragment(s)", pruned.len())),
    };
    if printed.is_ok() && matches!(output, TableOrJson::Table) {
        eprintln!("{verb} {} fragment(s)", pruned.len());
    }
    printed
}

/// `rotary fragments`: a journal's fragments and their states.
pub(super) async fn fragments(name: &str, output: TableOrJson, broker: &BrokerArgs) -> CmdResult {
    let client = connect(broker).await?;
    let fragments = client.fragments(name).await?;
    match output {
        TableOrJson::Json => print_json(&fragments),
        TableOrJson::Table => print_text(&output::fragments_table(&fragments, unix_now_secs())),
    }
}

/// The wall clock, read once per command: ages in tables are relative to it.
#[allow(clippy::disallowed_methods)] // The command line shows ages against the real clock.
fn unix_now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Names `journals apply` prints before it counts the rest.
const NAMES_SHOWN_MAX: usize = 10;

/// The names of `specs`, the first [`NAMES_SHOWN_MAX`] of them and how
/// many more: a file of thousands of journals makes one readable line.
fn name_list(specs: &[rotary_net::spec::JournalSpec]) -> String {
    let shown: Vec<&str> = specs
        .iter()
        .take(NAMES_SHOWN_MAX)
        .map(|s| s.name.as_str())
        .collect();
    let mut text = shown.join(", ");
    if specs.len() > shown.len() {
        text += &format!(" and {} more", specs.len() - shown.len());
    }
    text
}

/// Specs as YAML, each with the revision it was read at: `apply` of the
/// edited list changes only what did not change meanwhile.
fn revised_yaml(list: Vec<rotary_net::client::JournalInfo>) -> Result<String, CliError> {
    let specs: Vec<serde_yaml::Value> = list
        .into_iter()
        .map(|j| {
            let mut v = serde_yaml::to_value(&j.spec).unwrap_or_default();
            if let Some(m) = v.as_mapping_mut() {
                m.insert("revision".into(), j.revision.into());
            }
            v
        })
        .collect();
    serde_yaml::to_string(&specs)
        .context("encoding YAML")
        .map_err(|e| CliError::Other("OUTPUT_ERROR", e))
}

/// How often `journals list --watch` lists again.
const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// `journals list --watch`: a line per journal whose spec or route changed
/// (all of them at first), as long as the command runs.
async fn watch_journals(client: &Client, selector: &str) -> CmdResult {
    let mut seen: std::collections::BTreeMap<String, String> = Default::default();
    loop {
        let list = client.list(selector).await?;
        let mut now = std::collections::BTreeMap::new();
        for j in &list {
            let line = output::watch_line(j);
            if seen.get(&j.spec.name) != Some(&line) {
                print_text(&format!("{line}\n"))?;
            }
            now.insert(j.spec.name.clone(), line);
        }
        for gone in seen.keys().filter(|n| !now.contains_key(*n)) {
            print_text(&format!("{gone}\tdeleted\n"))?;
        }
        seen = now;
        tokio::time::sleep(WATCH_INTERVAL).await;
    }
}

/// `journals edit`: the selected specs in `$EDITOR` (`vi` without one),
/// applied when the editor exits 0 with the file changed.
async fn edit_journals(client: &Client, selector: &str) -> CmdResult {
    let list = client.list(selector).await?;
    let before = revised_yaml(list)?;
    let path = std::env::temp_dir().join(format!("rotary-edit-{}.yaml", std::process::id()));
    let _remove = RemoveOnDrop(path.clone());
    std::fs::write(&path, &before)
        .map_err(|e| CliError::Other("EDIT_FAILED", anyhow::Error::new(e)))?;
    let editor = std::env::var("EDITOR").unwrap_or_else(|_| "vi".into());
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(&path)
        .status()
        .map_err(|e| CliError::Other("EDIT_FAILED", anyhow::anyhow!("running {editor}: {e}")))?;
    if !status.success() {
        return Err(CliError::Other(
            "EDIT_FAILED",
            anyhow::anyhow!("{editor} exited with {status}; nothing applied"),
        ));
    }
    let after = std::fs::read_to_string(&path)
        .map_err(|e| CliError::Other("EDIT_FAILED", anyhow::Error::new(e)))?;
    if after == before {
        return print_text("no change\n");
    }
    let (text, revisions) = take_revisions(&after)?;
    let specs = parse_specs(&text).map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
    let revised: Vec<_> = specs.iter().cloned().zip(revisions).collect();
    let applied = client.apply_revised(&revised).await?;
    let text = format!("applied {applied} journal(s): {}", name_list(&specs));
    after_change(print_text(&format!("{text}\n")), || text)
}

/// Removes a file when dropped.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Takes the `revision` of each spec out of a specs document (a list or
/// one spec): the text without them, for [`parse_specs`], and each spec's
/// revision in order.
fn take_revisions(text: &str) -> Result<(String, Vec<Option<u64>>), CliError> {
    let bad = |why: String| CliError::Usage("BAD_REQUEST", why);
    let Ok(mut doc) = serde_yaml::from_str::<serde_yaml::Value>(text) else {
        // parse_specs says what is wrong with it.
        return Ok((text.to_string(), Vec::new()));
    };
    let mut take = |v: &mut serde_yaml::Value| -> Result<Option<u64>, CliError> {
        let Some(m) = v.as_mapping_mut() else {
            return Ok(None);
        };
        match m.remove("revision") {
            None => Ok(None),
            Some(r) => r
                .as_u64()
                .filter(|r| *r <= i64::MAX as u64)
                .map(Some)
                .ok_or_else(|| bad(format!("revision {r:?} is not a whole number of 0 or more"))),
        }
    };
    let revisions = match &mut doc {
        serde_yaml::Value::Sequence(items) => {
            items.iter_mut().map(&mut take).collect::<Result<_, _>>()?
        }
        v => vec![take(v)?],
    };
    if revisions.iter().all(Option::is_none) {
        return Ok((text.to_string(), revisions));
    }
    let text = serde_yaml::to_string(&doc).map_err(|e| bad(e.to_string()))?;
    Ok((text, revisions))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applied_names_are_counted_past_ten() {
        let specs = |n: usize| -> Vec<rotary_net::spec::JournalSpec> {
            (0..n)
                .map(|i| rotary_net::spec::JournalSpec::new(format!("a/j-{i:02}")))
                .collect()
        };
        assert_eq!(name_list(&specs(2)), "a/j-00, a/j-01");
        let ten = name_list(&specs(10));
        assert!(ten.ends_with("a/j-08, a/j-09"), "{ten}");
        let many = name_list(&specs(3000));
        assert!(
            many.ends_with("a/j-08, a/j-09 and 2990 more") && !many.contains("a/j-10"),
            "{many}"
        );
    }
}
