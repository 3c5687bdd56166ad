//! Admin requests: APPLY, LIST, PRUNE, DELETE, FRAGMENTS, SEAL, RESET_HEAD, ROUTE.

use super::*;

/// One entry of LIST's answer (PROTOCOL §9.3).
#[derive(serde::Serialize)]
pub(super) struct ListedOut {
    spec: Box<JournalSpec>,
    revision: u64,
    route: ListedRoute,
}

/// ROUTE's answer in short, for LIST.
#[derive(serde::Serialize)]
pub(super) struct ListedRoute {
    shard: u32,
    endpoint: String,
    /// The primary's id; empty if the route has no members.
    primary: String,
    members: Vec<String>,
    /// In a cluster on etcd, the etcd revision the route was read at.
    #[serde(skip_serializing_if = "Option::is_none")]
    etcd_revision: Option<i64>,
}

/// The status of a change of specs that could not be stored: a full disk
/// (or quota) is the retryable `STORAGE_FULL`, anything else `IO_ERROR`.
pub(super) fn spec_write_status(e: &crate::EngineError) -> Status {
    match e {
        crate::EngineError::Io(_, io)
            if matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
        {
            Status::STORAGE_FULL
        }
        _ => Status::IO_ERROR,
    }
}

/// The JSON payload of LIST and PRUNE: `{"selector": "…", "dry_run": bool}`,
/// and for LIST `"after"` and `"limit"`, every field optional, an empty
/// payload meaning `{}`.
pub(super) struct SelectorRequest {
    selector: LabelSelector,
    dry_run: bool,
    /// LIST: the page begins after this name.
    after: String,
    /// LIST: the most entries of the page.
    limit: usize,
}

impl SelectorRequest {
    fn parse(payload: &[u8], what: &str) -> Result<Self, String> {
        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            #[serde(default)]
            selector: String,
            #[serde(default)]
            dry_run: bool,
            #[serde(default)]
            after: String,
            limit: Option<u32>,
        }
        let raw: Raw = json_or_default(payload, what)?;
        let selector = LabelSelector::parse_journals(&raw.selector).map_err(|e| e.to_string())?;
        let max = wire::LIST_PAGE_MAX;
        let limit = raw.limit.unwrap_or(max);
        if limit == 0 || limit > max {
            return Err(format!("{what}: limit {limit} is outside 1..={max}"));
        }
        if what != "list" && (raw.limit.is_some() || !raw.after.is_empty()) {
            return Err(format!("{what}: after and limit are fields of list"));
        }
        Ok(SelectorRequest {
            selector,
            dry_run: raw.dry_run,
            after: raw.after,
            limit: limit as usize,
        })
    }
}

/// An admin request's JSON payload, an empty one meaning `{}`. Errors
/// name the request (`what`).
fn json_or_default<T>(payload: &[u8], what: &str) -> Result<T, String>
where
    T: serde::de::DeserializeOwned + Default,
{
    if payload.is_empty() {
        return Ok(T::default());
    }
    serde_json::from_slice(payload).map_err(|e| format!("{what}: {e}"))
}

/// The JSON payload of FRAGMENTS: `{"from": <offset>, "limit": <n>}`,
/// both optional, an empty payload meaning `{}` (PROTOCOL §9.5).
pub(super) struct PageRequest {
    from: u64,
    limit: usize,
}

impl PageRequest {
    fn parse(payload: &[u8]) -> Result<Self, String> {
        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            #[serde(default)]
            from: u64,
            limit: Option<u32>,
        }
        let raw: Raw = json_or_default(payload, "fragments")?;
        let max = wire::FRAGMENTS_PAGE_MAX;
        let limit = raw.limit.unwrap_or(max);
        if limit == 0 || limit > max {
            return Err(format!("fragments: limit {limit} is outside 1..={max}"));
        }
        Ok(PageRequest {
            from: raw.from,
            limit: limit as usize,
        })
    }
}

/// APPLY's payload: a JSON array of specs, each of which may carry the
/// revision it expects (checked apart, see `check_expected_revisions`).
pub(super) fn parse_apply(payload: &[u8]) -> Result<Vec<JournalSpec>, String> {
    match serde_json::from_slice::<Vec<JournalSpec>>(payload) {
        Ok(specs) => Ok(specs),
        Err(e) => match super::etcd::parse_apply_revised(payload) {
            Ok(specs) => Ok(specs.into_iter().map(|(s, _)| s).collect()),
            // serde's own message for `{...}` is "invalid type: map", even
            // when the text is not JSON at all: say what is expected first.
            Err(_) => Err(format!("specs must be a JSON array of journal specs: {e}")),
        },
    }
}

/// Checks specs applied together: each one, no journal twice, and every
/// store URL in full (a store the uploader could not use would fail every
/// append of the journal later, with a retryable status).
pub(super) fn check_specs(specs: &[JournalSpec]) -> Result<(), String> {
    rotary_net::spec::validate_specs(specs).map_err(|e| e.to_string())?;
    for s in specs {
        for store in &s.fragment.stores {
            let url = rotary_uploader::StoreUrl::parse(store)
                .map_err(|e| format!("spec of {:?}: {e}", s.name))?;
            if let Some(dir) = url.file_dir() {
                check_store_dir(dir).map_err(|e| format!("spec of {:?}: {e}", s.name))?;
            }
        }
    }
    Ok(())
}

/// A `file://` store's directory need not exist yet (uploads create it),
/// but nothing on its path may be a file that is not a directory: every
/// upload would fail.
pub(super) fn check_store_dir(dir: &std::path::Path) -> Result<(), String> {
    // Without the trailing '/': `file/` does not "exist", `file` does.
    let dir: std::path::PathBuf = dir.components().collect();
    let Some(existing) = dir.ancestors().find(|p| p.exists()) else {
        return Ok(());
    };
    if existing.is_dir() {
        Ok(())
    } else {
        Err(format!(
            "store directory {}: {} exists and is not a directory",
            dir.display(),
            existing.display()
        ))
    }
}

/// Longest a FRAGMENTS request waits for its journal's first store listing.
pub(super) const FRAGMENTS_LISTING_WAIT: Duration = Duration::from_secs(30);

/// The JSON array of as many of `entries`, from the first, as fit in
/// `limit` bytes, at least one; and how many that is. Each entry is
/// serialized once.
pub(super) fn json_array_within<T: serde::Serialize>(
    entries: &[T],
    limit: usize,
) -> (Vec<u8>, usize) {
    let mut out = vec![b'['];
    let mut n = 0;
    for e in entries {
        let json = serde_json::to_vec(e).expect("json");
        // A comma before it, unless first, and the closing bracket.
        if n > 0 && out.len() + 1 + json.len() + 1 > limit {
            break;
        }
        if n > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&json);
        n += 1;
    }
    out.push(b']');
    (out, n)
}

impl Conn {
    pub(super) fn admin_err(&self, id: u64, status: Status, message: &str) {
        self.outbox.error(Op::ADMIN_REPLY, status, id, &[], message);
    }

    pub(super) fn admin_ok(&self, id: u64, body: &serde_json::Value) {
        let bytes = serde_json::to_vec(body).expect("json");
        self.outbox
            .frame(Op::ADMIN_REPLY, Status::OK, id, &[], &bytes);
    }

    pub(super) async fn apply(&self, id: u64, payload: &[u8]) {
        if let Some(control) = self.shard.topology().control() {
            return self.apply_in_etcd(control, id, payload).await;
        }
        if let Some(why) = self.specs_from_file("APPLY") {
            return self.admin_err(id, Status::NOT_ALLOWED, &why);
        }
        let specs = match parse_apply(payload) {
            Ok(specs) => specs,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        if let Err(e) = check_specs(&specs) {
            return self.admin_err(id, Status::BAD_REQUEST, &e);
        }
        if let Err(e) = self.check_expected_revisions(payload) {
            return self.admin_err(id, Status::ETCD_TRANSACTION_FAILED, &e);
        }
        let revision = self.shard.specs.next_revision();
        match self.shard.specs.apply_at(specs, revision) {
            Ok(n) => self.admin_ok(
                id,
                &serde_json::json!({ "applied": n, "revision": revision }),
            ),
            Err(e) => self.admin_err(id, spec_write_status(&e), &e.to_string()),
        }
    }

    /// In a cluster from a file, the refusal of a request that would
    /// change specs: they are the file's.
    fn specs_from_file(&self, what: &str) -> Option<String> {
        let view = self.shard.view();
        (!view.is_single()).then(|| {
            format!(
                "{what} is not allowed in a cluster from a file: its journal specs are the file's \
                 `journals`; edit the file on every broker"
            )
        })
    }

    /// ROUTE, answered once this broker's view has reached the revision
    /// the request asks for (if it can).
    pub(super) async fn route(&self, id: u64, meta: &[u8]) {
        let (name, revision) = match wire::decode_route(meta) {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, e.status(), &e.to_string()),
        };
        if let Err(e) = rotary_net::spec::validate_journal_name(name) {
            return self.admin_err(id, Status::BAD_REQUEST, &e.to_string());
        }
        if !self.shard.await_revision(revision).await {
            let msg = self.shard.behind_message(revision);
            return self.admin_err(id, Status::WRONG_ROUTE, &msg);
        }
        let body = self.route_json(name);
        self.admin_ok(id, &body);
    }

    /// ROUTE's answer: this broker's shard for the journal, and its route.
    pub(super) fn route_json(&self, name: &str) -> serde_json::Value {
        let shard = rotary_net::shard_of(name, self.shard.shards);
        let replication = self.shard.specs.get(name).map_or(1, |s| s.replication);
        let view = self.shard.view();
        let route = view.route(name, replication);
        let local = self.shard.endpoints[shard as usize].to_string();
        let members: Vec<serde_json::Value> = route
            .members
            .iter()
            .map(|m| {
                serde_json::json!({
                    "id": m.id,
                    "zone": m.zone,
                    "endpoint": self.shard.member_endpoint(m, name).to_string(),
                })
            })
            .collect();
        let endpoint = self.shard.primary_endpoint(&route, name).to_string();
        serde_json::json!({
            "journal": name,
            "shard": shard,
            "shards": self.shard.shards,
            "endpoint": endpoint,
            "broker": view.me,
            "local_endpoint": local,
            "members": members,
            "revision": view.revision(),
        })
    }

    pub(super) fn list(&self, id: u64, payload: &[u8]) {
        let req = match SelectorRequest::parse(payload, "list") {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        let sel = &req.selector;
        let (page, more) = self.shard.specs.page(&req.after, req.limit, |s| {
            sel.matches_journal(&s.name, &s.labels)
        });
        let view = self.shard.view();
        let out: Vec<ListedOut> = page
            .into_iter()
            .map(|r| {
                let name = &r.spec.name;
                let shard = rotary_net::shard_of(name, self.shard.shards);
                let route = view.route(name, r.spec.replication);
                let endpoint = self.shard.primary_endpoint(&route, name);
                let members: Vec<String> = route.members.into_iter().map(|m| m.id).collect();
                ListedOut {
                    route: ListedRoute {
                        shard,
                        endpoint: endpoint.to_string(),
                        primary: members.first().cloned().unwrap_or_default(),
                        members,
                        etcd_revision: view.assigned.as_ref().map(|a| a.revision),
                    },
                    spec: Box::new(r.spec),
                    revision: r.revision,
                }
            })
            .collect();
        let mut flags = 0;
        // A page also ends before its reply would outgrow a frame (specs
        // may carry many labels); the next one starts after its last name.
        let (bytes, listed) = json_array_within(&out, wire::PAYLOAD_LEN_MAX);
        if more || listed < out.len() {
            flags |= flag::NEXT_PAGE;
        }
        self.outbox
            .flagged_frame(Op::ADMIN_REPLY, flags, Status::OK, id, &[], &bytes);
    }

    pub(super) async fn prune(&self, id: u64, payload: &[u8]) {
        let req = match SelectorRequest::parse(payload, "prune") {
            Ok(r) => r,
            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
        };
        match self.shard.prune(&req.selector, req.dry_run).await {
            Ok(removed) => self.admin_ok(id, &serde_json::Value::Array(removed)),
            Err(e) => self.admin_err(id, Status::FRAGMENT_STORE_UNHEALTHY, &e),
        }
    }

    /// DELETE of journal `name`: in etcd, or on a single node its spec and
    /// its files here.
    async fn delete(&mut self, frame: &Frame<'_>, name: &str, not_found: &str) {
        let id = frame.request_id;
        if let Some(control) = self.shard.topology().control() {
            let control = control.clone();
            return self
                .delete_in_etcd(&control, id, name, frame.payload, not_found)
                .await;
        }
        if let Some(why) = self.specs_from_file("DELETE") {
            return self.admin_err(id, Status::NOT_ALLOWED, &why);
        }
        if !frame.payload.is_empty() {
            return self.admin_err(id, Status::BAD_REQUEST, "DELETE takes no payload");
        }
        if let Err(f) = self.shard.record_deletion(name).await {
            return self.admin_err(id, f.status, &f.message);
        }
        match self.shard.delete_journal(name) {
            Ok(true) => self.admin_ok(id, &serde_json::json!({ "deleted": name })),
            Ok(false) => self.admin_err(id, Status::JOURNAL_NOT_FOUND, not_found),
            Err(e) => self.admin_err(id, spec_write_status(&e), &e.to_string()),
        }
    }

    pub(super) async fn by_name(&mut self, frame: Frame<'_>, raw: &[u8]) {
        let id = frame.request_id;
        let name = match wire::decode_name(frame.meta) {
            Ok(n) => n.to_string(),
            Err(e) => return self.admin_err(id, e.status(), &e.to_string()),
        };
        if let Err(e) = validate_journal_name(&name) {
            return self.admin_err(id, Status::BAD_REQUEST, &e.to_string());
        }
        let owner = rotary_net::shard_of(&name, self.shard.shards);
        if owner != self.shard.index {
            let addr = self.shard.endpoints[owner as usize];
            metrics::add(&self.shard.metrics.cross_core_forwards, 1);
            return self.forward_to(addr, raw).await;
        }
        let not_found = format!("journal {name:?} does not exist");
        match frame.op {
            Op::DELETE => self.delete(&frame, &name, &not_found).await,
            op => {
                let Some(j) = self.shard.journal(&name) else {
                    let (status, msg) = self.shard.unknown_journal(&name);
                    return self.admin_err(id, status, &msg);
                };
                if matches!(op, Op::SEAL | Op::RESET_HEAD) {
                    // Only the primary decides where fragments end.
                    let role = self.shard.role(&j.borrow().spec);
                    if let Role::Replica(route) | Role::Outside(route) = role {
                        if let Some(p) = route.primary() {
                            let addr = self.shard.member_endpoint(p, &name);
                            metrics::add(&self.shard.metrics.proxied_requests, 1);
                            return self.forward_to(addr, raw).await;
                        }
                    }
                }
                match op {
                    Op::FRAGMENTS => {
                        let page = match PageRequest::parse(frame.payload) {
                            Ok(p) => p,
                            Err(e) => return self.admin_err(id, Status::BAD_REQUEST, &e),
                        };
                        // In its own task; the connection goes on.
                        let task =
                            answer_fragments(self.shard.clone(), self.outbox.clone(), j, id, page);
                        compio::runtime::spawn(task).detach();
                    }
                    Op::RESET_HEAD => self.shard.request_reset_head(&j, self.outbox.clone(), id),
                    Op::SEAL => self.shard.request_seal(&j, self.outbox.clone(), id),
                    _ => unreachable!("by_name handles DELETE, FRAGMENTS, SEAL, RESET_HEAD"),
                }
            }
        }
    }
}

/// Answers FRAGMENTS with a page of the journal's fragments. Before the
/// first listing of its store a journal's fragments are not known: the
/// answer waits for it, or is the listing's error.
async fn answer_fragments(
    shard: Rc<Shard>,
    outbox: Rc<Outbox>,
    j: JournalRef,
    id: u64,
    page: PageRequest,
) {
    let deadline = crate::clock::now() + FRAGMENTS_LISTING_WAIT;
    loop {
        let listen = j.borrow().readers.committed.listen();
        let (listed, failed) = {
            let jm = j.borrow();
            (jm.index.loaded, jm.index.error.clone())
        };
        if listed {
            break;
        }
        let left = deadline.saturating_duration_since(crate::clock::now());
        let failed = failed.or_else(|| {
            left.is_zero()
                .then(|| format!("no listing in {FRAGMENTS_LISTING_WAIT:?}"))
        });
        if let Some(e) = failed {
            return crate::shard::refuse_unlisted(&outbox, id, &e);
        }
        if outbox.is_closed() {
            return;
        }
        // Ahead of the shard's queue, as a read's.
        shard.hurry_first_listing(&j);
        let _ = compio::time::timeout(left, listen).await;
    }
    let (body, more) = shard.fragments_page(&j, page.from, page.limit);
    let bytes = serde_json::to_vec(&body).expect("json");
    let flags = if more { flag::NEXT_PAGE } else { 0 };
    outbox.flagged_frame(Op::ADMIN_REPLY, flags, Status::OK, id, &[], &bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_array_within_keeps_to_its_limit() {
        let entries: Vec<String> = (0..10).map(|i| format!("{i:08}")).collect();
        for limit in 0..150 {
            let (bytes, k) = json_array_within(&entries, limit);
            assert_eq!(bytes, serde_json::to_vec(&entries[..k]).unwrap());
            assert!(k >= 1);
            assert!(
                bytes.len() <= limit || k == 1,
                "limit {limit}: {k} entries, {} bytes",
                bytes.len()
            );
            if k < entries.len() {
                let more = serde_json::to_vec(&entries[..k + 1]).unwrap().len();
                assert!(more > limit, "limit {limit}: {k} entries, one more fits");
            }
        }
    }
}
