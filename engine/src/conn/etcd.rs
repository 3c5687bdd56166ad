//! Admin requests in a cluster on etcd: APPLY and DELETE become guarded
//! etcd transactions, carried out by the control thread; and the revision
//! checks APPLY makes outside etcd.

use super::admin::check_specs;
use super::*;
use crate::cluster::control::{ControlError, ControlHandle, MemberInfo};

impl Conn {
    /// MEMBERS: in a cluster on etcd, every member as etcd holds it; else
    /// the brokers of this broker's view, with the journals routed to them.
    pub(super) async fn members(&self, id: u64) {
        let list = match self.shard.topology().control() {
            Some(control) => match control.members().await {
                Ok(list) => list,
                Err(e) => return self.admin_err(id, control_status(&e), &e.to_string()),
            },
            None => self.members_of_view(),
        };
        self.admin_ok(id, &serde_json::json!(list));
    }

    fn members_of_view(&self) -> Vec<MemberInfo> {
        let view = self.shard.view();
        let mut held: HashMap<String, (usize, usize)> = HashMap::new();
        for spec in self.shard.specs.all() {
            let route = view.route(&spec.name, spec.replication);
            for (i, m) in route.members.iter().enumerate() {
                let h = held.entry(m.id.clone()).or_default();
                h.0 += 1;
                h.1 += usize::from(i == 0);
            }
        }
        view.brokers
            .iter()
            .map(|m| {
                let (journals, primaries) = held.get(&m.id).copied().unwrap_or_default();
                MemberInfo {
                    id: m.id.clone(),
                    zone: m.zone.clone(),
                    endpoint: m.endpoint.to_string(),
                    journal_limit: 0,
                    journals,
                    primaries,
                    exiting: false,
                }
            })
            .collect()
    }

    /// DRAIN: marks a member exiting (a cluster on etcd only).
    pub(super) async fn drain_member(&self, id: u64, payload: &[u8]) {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Drain {
            id: String,
        }
        let req: Drain = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &format!("DRAIN: {e}")),
        };
        let Some(control) = self.shard.topology().control() else {
            let msg = "DRAIN needs a cluster on etcd: stop a broker of a cluster file with SIGTERM";
            return self.admin_err(id, Status::NOT_ALLOWED, msg);
        };
        match control.drain_member(req.id.clone()).await {
            Ok(revision) => self.admin_ok(
                id,
                &serde_json::json!({ "draining": req.id, "revision": revision }),
            ),
            Err(e) => self.admin_err(id, control_status(&e), &e.to_string()),
        }
    }

    /// APPLY in a cluster on etcd: one transaction of every spec, each
    /// guarded by the revision the client gave with it (`"revision"`; 0:
    /// the journal must not exist), answered once this broker's spec store
    /// holds the change.
    pub(super) async fn apply_in_etcd(&self, control: &ControlHandle, id: u64, payload: &[u8]) {
        let specs = match parse_apply_revised(payload) {
            Ok(s) => s,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        let plain: Vec<JournalSpec> = specs.iter().map(|(s, _)| s.clone()).collect();
        if let Err(e) = check_specs(&plain) {
            return self.admin_err(id, Status::BAD_REQUEST, &e);
        }
        let n = specs.len();
        match control.apply(specs).await {
            Ok(revision) => {
                self.wait_for_revision(revision).await;
                self.admin_ok(
                    id,
                    &serde_json::json!({ "applied": n, "revision": revision }),
                )
            }
            Err(e) => self.admin_err(id, control_status(&e), &e.to_string()),
        }
    }

    /// Outside etcd, the revisions a client's APPLY expects of its specs
    /// (as `journals list -o yaml` prints them) are checked against the
    /// store's, so that list, edit, apply is as safe a round trip as in a
    /// cluster on etcd. (Two APPLYs racing on different shards may both
    /// pass; etcd's transactions have no such gap.)
    pub(super) fn check_expected_revisions(&self, payload: &[u8]) -> Result<(), String> {
        let Ok(revised) = parse_apply_revised(payload) else {
            return Ok(());
        };
        for (spec, expect) in revised {
            let Some(expect) = expect else { continue };
            let now = self
                .shard
                .specs
                .get_revised(&spec.name)
                .map_or(0, |r| r.revision);
            if now != expect as u64 {
                return Err(format!(
                    "journal {:?} is at revision {now}, not {expect}: list it again",
                    spec.name
                ));
            }
        }
        Ok(())
    }

    /// Waits (bounded) until the spec store took etcd's change at
    /// `revision`, so that a LIST right after an APPLY shows it.
    async fn wait_for_revision(&self, revision: i64) {
        let give_up = crate::clock::now() + REVISION_WAIT_MAX;
        while self.shard.specs.revision_seen() < revision as u64 && crate::clock::now() < give_up {
            compio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// DELETE in a cluster on etcd: the journal's item goes in a
    /// transaction, guarded by the revision the client gave (if any).
    pub(super) async fn delete_in_etcd(
        &self,
        control: &ControlHandle,
        id: u64,
        name: &str,
        payload: &[u8],
        not_found: &str,
    ) {
        let expect = match parse_delete_expect(payload) {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        match control.delete(name.to_string(), expect).await {
            Ok(revision) => {
                self.wait_for_revision(revision).await;
                self.admin_ok(
                    id,
                    &serde_json::json!({ "deleted": name, "revision": revision }),
                )
            }
            Err(ControlError::TxnFailed(_)) if expect.is_none() => {
                self.admin_err(id, Status::JOURNAL_NOT_FOUND, not_found)
            }
            Err(e) => self.admin_err(id, control_status(&e), &e.to_string()),
        }
    }
}

/// How long an APPLY or DELETE in a cluster on etcd waits for the watch
/// to bring its change to this broker before it answers all the same.
const REVISION_WAIT_MAX: Duration = Duration::from_secs(5);

/// The status of a request the control thread could not carry out.
fn control_status(e: &ControlError) -> Status {
    match e {
        ControlError::TxnFailed(_) => Status::ETCD_TRANSACTION_FAILED,
        ControlError::NotFound(_) => Status::NOT_ALLOWED,
        // etcd refused the request itself (too large, malformed): sending
        // it again cannot help.
        ControlError::Etcd(e) if !e.is_retryable() => Status::BAD_REQUEST,
        ControlError::Etcd(_) | ControlError::Gone => Status::IO_ERROR,
    }
}

/// APPLY's payload in a cluster on etcd: a JSON array of journal specs,
/// each of which may carry `"revision"`, the revision of the journal's
/// spec the change was made from (0: the journal must not exist yet).
pub(super) fn parse_apply_revised(
    payload: &[u8],
) -> Result<Vec<(JournalSpec, Option<i64>)>, String> {
    let values: Vec<serde_json::Value> = serde_json::from_slice(payload)
        .map_err(|e| format!("specs must be a JSON array of journal specs: {e}"))?;
    values
        .into_iter()
        .map(|mut v| {
            let revision =
                match v.as_object_mut().and_then(|o| o.remove("revision")) {
                    None => None,
                    Some(r) => Some(r.as_i64().filter(|r| *r >= 0).ok_or_else(|| {
                        format!("revision {r} is not a whole number of 0 or more")
                    })?),
                };
            let spec: JournalSpec = serde_json::from_value(v).map_err(|e| e.to_string())?;
            Ok((spec, revision))
        })
        .collect()
}

/// DELETE's payload in a cluster on etcd: empty, or `{"revision": N}`, the
/// revision of the spec the deletion was decided on.
fn parse_delete_expect(payload: &[u8]) -> Result<Option<i64>, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Revision {
        revision: i64,
    }
    if payload.is_empty() {
        return Ok(None);
    }
    let r = serde_json::from_slice::<Revision>(payload).map_err(|e| format!("delete: {e}"))?;
    Ok(Some(r.revision))
}
