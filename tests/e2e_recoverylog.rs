//! A recovery log in a real broker's journal: a recorder's files played
//! back byte for byte by another process's player, a hand-off that sets
//! the log's author register, and the old recorder (a zombie primary)
//! refused at its next append, with nothing of it in the journal.

#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rotary_consumer::journal::{author_value, JournalSink, JournalSource, AUTHOR_REGISTER};
use rotary_consumer::recoverylog::{
    Author, Error, Hints, Player, PlayerConfig, Recorder, SinkError,
};
use std::collections::BTreeMap;
use std::path::Path;

const LOG: &str = "recovery/shard-000";

type Files = BTreeMap<String, Vec<u8>>;

/// Every file under `root`, by relative path.
fn files_under(root: &Path) -> Files {
    let mut out = Files::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.insert(rel, std::fs::read(&path).expect("read file"));
            }
        }
    }
    out
}

struct Log {
    client: rotary_net::client::Client,
    rt: tokio::runtime::Handle,
}

impl Log {
    fn player(&self, root: &Path) -> Player<JournalSource> {
        let source = JournalSource::new(self.client.clone(), LOG, self.rt.clone());
        Player::new(PlayerConfig::new(LOG, root), &Hints::origin(LOG), source).expect("player")
    }

    /// Plays the log into `root` and takes it over as `author`.
    fn take_over(&self, root: &Path, author: u32) -> Recorder<JournalSink> {
        let author = Author::new(author).expect("non-zero");
        let sink = JournalSink::new(self.client.clone(), LOG, author, self.rt.clone());
        self.player(root).handoff(author, sink).expect("hand-off")
    }

    /// The files a fresh player rebuilds from the whole log.
    fn played(&self, root: &Path) -> Files {
        let mut p = self.player(root);
        p.play().expect("play");
        files_under(root)
    }
}

/// A recorder writes a file the way a store does: create, write, barrier.
fn write_file(
    rec: &mut Recorder<JournalSink>,
    path: &str,
    at: u64,
    data: &[u8],
) -> Result<(), Error> {
    let fnode = match rec.fnode(path) {
        Some(f) => f,
        None => rec.create(path)?,
    };
    rec.write(fnode, at, data)?;
    rec.barrier()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_off_recorder_is_fenced_and_players_rebuild_the_new_authors_files() {
    let broker = Broker::start();
    let client = broker.client().await;
    create_journal(&client, LOG, |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let log = Log {
        client: client.clone(),
        rt: tokio::runtime::Handle::current(),
    };
    let root = dir.path().to_path_buf();
    let head_client = client.clone();
    tokio::task::spawn_blocking(move || {
        let mut expected = Files::new();
        // The first primary takes the empty log over and records two
        // transactions.
        let mut a = log.take_over(&root.join("a"), 1);
        write_file(&mut a, "db/main.db", 0, b"first page").unwrap();
        write_file(&mut a, "db/main.db", 10, b", second page").unwrap();
        expected.insert("db/main.db".into(), b"first page, second page".to_vec());
        // A standby (another process) plays the log: the same bytes.
        assert_eq!(log.played(&root.join("standby")), expected);

        // The standby is promoted: it plays to the end and hands off.
        let mut b = log.take_over(&root.join("b"), 2);
        assert_eq!(files_under(&root.join("b")), expected);
        let head = log.rt.block_on(write_head(&head_client, LOG));

        // The old primary is a zombie now: its next append is refused by
        // the author register, and nothing of it lands.
        let zombie = write_file(&mut a, "db/main.db", 0, b"ZOMBIE");
        assert!(
            matches!(zombie, Err(Error::Sink(SinkError::Fenced))),
            "{zombie:?}"
        );
        assert_eq!(log.rt.block_on(write_head(&head_client, LOG)), head);
        // Stopped for good.
        assert!(write_file(&mut a, "other", 0, b"x").is_err());

        write_file(&mut b, "db/main.db", 0, b"FIRST").unwrap();
        write_file(&mut b, "db/wal", 0, b"wal bytes").unwrap();
        expected.insert("db/main.db".into(), b"FIRST page, second page".to_vec());
        expected.insert("db/wal".into(), b"wal bytes".to_vec());
        assert_eq!(log.played(&root.join("fresh")), expected);
    })
    .await
    .expect("the recorder thread");

    // The register names the new author: an append checked against the
    // old one is refused, one checked against the new one lands.
    let check = |author: u32| {
        let text = format!(
            "{AUTHOR_REGISTER}={}",
            author_value(Author::new(author).unwrap())
        );
        rotary_net::wire::AppendRequest {
            journal: LOG.into(),
            expect_offset: None,
            check_registers: rotary_net::spec::LabelSelector::parse(&text).unwrap(),
            union_registers: Default::default(),
            subtract_registers: Default::default(),
            route_revision: 0,
        }
    };
    let old = client.append(&check(1), b"x".to_vec()).await;
    assert_eq!(status_of(old), rotary_net::Status::REGISTER_MISMATCH);
    let new = client.append(&check(2), Vec::new()).await.expect("append");
    assert_eq!(
        new.registers.values_of(AUTHOR_REGISTER).collect::<Vec<_>>(),
        [author_value(Author::new(2).unwrap())]
    );
}
