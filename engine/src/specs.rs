//! The journal spec store of a single-node broker: specs live in
//! `<data>/specs.json`, shared by every shard behind a lock. Specs change
//! rarely and never on the data path; shards notice changes through
//! `version` and refresh their local copies.

use crate::EngineError;
use rotary_net::spec::JournalSpec;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

pub struct SpecStore {
    path: PathBuf,
    specs: Mutex<BTreeMap<String, JournalSpec>>,
    version: AtomicU64,
}

impl SpecStore {
    pub fn open(path: PathBuf) -> Result<SpecStore, EngineError> {
        let specs = match std::fs::read(&path) {
            Ok(bytes) => {
                let list: Vec<JournalSpec> = serde_json::from_slice(&bytes)
                    .map_err(|e| EngineError::Config(format!("{}: {e}", path.display())))?;
                list.into_iter().map(|s| (s.name.clone(), s)).collect()
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(EngineError::Io(path, e)),
        };
        Ok(SpecStore {
            path,
            specs: Mutex::new(specs),
            version: AtomicU64::new(1),
        })
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub fn get(&self, name: &str) -> Option<JournalSpec> {
        self.specs.lock().expect("spec lock").get(name).cloned()
    }

    pub fn all(&self) -> Vec<JournalSpec> {
        self.specs
            .lock()
            .expect("spec lock")
            .values()
            .cloned()
            .collect()
    }

    /// Creates or replaces specs, all or none, and persists them.
    pub fn apply(&self, specs: Vec<JournalSpec>) -> Result<usize, EngineError> {
        let mut map = self.specs.lock().expect("spec lock");
        let mut next = map.clone();
        let n = specs.len();
        for s in specs {
            next.insert(s.name.clone(), s);
        }
        self.persist(&next)?;
        *map = next;
        self.version.fetch_add(1, Ordering::AcqRel);
        Ok(n)
    }

    /// Removes a spec; false if it did not exist.
    pub fn delete(&self, name: &str) -> Result<bool, EngineError> {
        let mut map = self.specs.lock().expect("spec lock");
        if !map.contains_key(name) {
            return Ok(false);
        }
        let mut next = map.clone();
        next.remove(name);
        self.persist(&next)?;
        *map = next;
        self.version.fetch_add(1, Ordering::AcqRel);
        Ok(true)
    }

    fn persist(&self, map: &BTreeMap<String, JournalSpec>) -> Result<(), EngineError> {
        let list: Vec<&JournalSpec> = map.values().collect();
        let bytes = serde_json::to_vec_pretty(&list).expect("specs serialize");
        let tmp = self.path.with_extension("json.next");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_data()?;
            std::fs::rename(&tmp, &self.path)?;
            std::fs::File::open(self.path.parent().expect("has parent"))?.sync_all()
        };
        write().map_err(|e| EngineError::Io(self.path.clone(), e))
    }
}
