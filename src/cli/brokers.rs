//! `rotary brokers …` and `rotary stats`: the cluster's members, draining
//! one, and a broker's counters.

use super::broker::{connect, BrokerArgs};
use super::exit::{after_change, print_json, print_text, CmdResult};
use super::TableOrJson;
use crate::output;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub(super) enum BrokersCmd {
    /// Lists the brokers: id, zone, endpoint, journal limit, journals and
    /// primaries held, and whether each is exiting.
    List {
        #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
        output: TableOrJson,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Marks a broker exiting: the allocator moves its journals to other
    /// brokers (each replacement added before the broker's copy goes), and
    /// the broker stops once it holds none. A cluster on etcd only.
    Drain {
        /// The broker's member id.
        id: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
}

pub(super) async fn brokers(cmd: BrokersCmd) -> CmdResult {
    match cmd {
        BrokersCmd::List { output, broker } => {
            let client = connect(&broker).await?;
            let members = client.members().await?;
            match output {
                TableOrJson::Json => print_json(&members),
                TableOrJson::Table => print_text(&output::brokers_table(&members)),
            }
        }
        BrokersCmd::Drain { id, broker } => {
            let client = connect(&broker).await?;
            client.drain(&id).await?;
            after_change(print_text(&format!("draining {id}\n")), || {
                format!("draining {id}")
            })
        }
    }
}

/// `rotary stats`: the broker's counters as JSON.
pub(super) async fn stats(broker: &BrokerArgs) -> CmdResult {
    let client = connect(broker).await?;
    let stats = client.stats().await?;
    print_json(&stats)
}
