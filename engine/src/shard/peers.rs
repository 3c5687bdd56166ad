//! Catching up journal specs and store listings from peer brokers.

use super::*;

impl Shard {
    /// Learns the spec changes made while this broker was down. APPLY and
    /// DELETE reach the brokers that are up; one that starts later asks each
    /// peer for its specs and tombstones and takes whatever has a later
    /// revision than its own: journals created or changed meanwhile, and
    /// journals deleted meanwhile (deleted here through their shard, files
    /// and all). A peer that does not answer is asked again, soon at first
    /// (brokers of a cluster often start together), then every 5 s, for a
    /// minute at most. After that it asks every peer again each
    /// `spec_sync_interval`.
    pub(super) async fn catch_up_specs(self: Rc<Self>) {
        const GIVE_UP: std::time::Duration = std::time::Duration::from_secs(60);
        const PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(5);
        let started = crate::clock::now();
        let mut pause = std::time::Duration::from_millis(100);
        let view = self.view();
        let mut waiting: Vec<_> = view.brokers.iter().filter(|m| m.id != view.me).collect();
        // The views first, from every peer at once and for one ack timeout
        // at most: takeovers wait for them (see `sync_replicas`), and a
        // peer that hangs must not hold them up for longer. One that
        // answers only later still tells its views below.
        let me = &*self;
        join_all(waiting.iter().map(|m| async move {
            if let Some(stats) = me.peer_stats(m, me.replica_ack_timeout).await {
                me.learn_views(m, &stats);
            }
        }))
        .await;
        self.topology.mark_peers_asked();
        loop {
            let mut still = Vec::new();
            for m in waiting {
                if !self.sync_specs_with(m).await {
                    still.push(m);
                }
            }
            waiting = still;
            if waiting.is_empty() || crate::clock::elapsed(started) >= GIVE_UP {
                break;
            }
            compio::time::sleep(pause).await;
            pause = (pause * 2).min(PAUSE_MAX);
        }
        if waiting.is_empty() {
            tracing::info!("learned the journal specs of every peer");
        } else {
            let silent: Vec<&str> = waiting.iter().map(|m| m.id.as_str()).collect();
            tracing::warn!(peers = ?silent, "some peers never listed their journal specs; journals unknown here now answer JOURNAL_NOT_FOUND");
        }
        self.specs.mark_caught_up();
        // Then now and again, for changes a peer's fan-out did not deliver
        // while this broker was up (a timeout, a stalled process).
        if self.spec_sync_interval.is_zero() {
            return;
        }
        loop {
            compio::time::sleep(self.spec_sync_interval).await;
            let view = self.view();
            for m in view.brokers.iter().filter(|m| m.id != view.me) {
                self.sync_specs_with(m).await;
            }
        }
    }

    /// Lists a peer's specs and tombstones and takes the newer ones, unless
    /// its STATS show the same specs as this broker's; false if the peer
    /// did not answer.
    pub(super) async fn sync_specs_with(&self, peer: &Member) -> bool {
        let Some(stats) = self.peer_stats(peer, PEER_LIST_TIMEOUT).await else {
            return false;
        };
        // The views first: a journal this broker learns of below may have
        // left a broker in a change it never saw.
        if !self.specs.is_caught_up() {
            self.learn_views(peer, &stats);
        }
        if self.same_specs(&stats) {
            metrics::add(&self.metrics.spec_syncs_unchanged, 1);
            return true;
        }
        metrics::add(&self.metrics.spec_syncs_full, 1);
        // Every page first, then one change of the store for all of them.
        let mut entries = Vec::new();
        let mut after = String::new();
        loop {
            let body = rotary_net::wire::list_payload("", true, &after);
            let listed =
                crate::pipeline::unary(peer.endpoint, Op::LIST, 0, &[], &body, PEER_LIST_TIMEOUT)
                    .await;
            let Ok((Status::OK, flags, payload)) = listed else {
                return false;
            };
            let page = match serde_json::from_slice::<Vec<Listed>>(&payload) {
                Ok(page) => page,
                Err(e) => {
                    tracing::warn!(peer = %peer.id, error = %e, "a peer's journal list did not parse");
                    return true;
                }
            };
            let next = match page.last() {
                Some(last) if flags & rotary_net::wire::flag::NEXT_PAGE != 0 => last
                    .spec
                    .as_ref()
                    .map(|s| s.name.clone())
                    .or(last.deleted.clone()),
                _ => None,
            };
            entries.extend(page);
            match next {
                Some(next) => after = next,
                None => break,
            }
        }
        self.adopt_newer(&peer.id, entries).await;
        true
    }

    /// A peer's STATS, or `None` if it did not answer OK within `timeout`
    /// (a body that does not parse is `null`).
    pub(super) async fn peer_stats(
        &self,
        peer: &Member,
        timeout: std::time::Duration,
    ) -> Option<serde_json::Value> {
        let stats = crate::pipeline::unary(peer.endpoint, Op::STATS, 0, &[], &[], timeout).await;
        let Ok((Status::OK, _, payload)) = stats else {
            return None;
        };
        Some(serde_json::from_slice(&payload).unwrap_or_default())
    }

    /// Whether a peer's STATS show the same count and digest of specs as
    /// this broker's store (false if they show none). A deletion shows
    /// too: the peer lacks the spec. Only tombstones are not compared, and
    /// they matter only to a spec older than the deletion, which one of
    /// the two would then hold.
    pub(super) fn same_specs(&self, stats: &serde_json::Value) -> bool {
        let (count, digest) = self.specs.digest();
        stats["specs"].as_u64() == Some(count as u64)
            && stats["specs_digest"].as_str() == Some(format!("{digest:032x}").as_str())
    }

    /// Takes the cluster views a peer's STATS list as earlier views of
    /// this broker (see [`Topology::learn`]), while it starts: changes
    /// made while it was down, or before it first started, name brokers
    /// that journals left and that it never saw. Afterwards its own file
    /// watch sees every change.
    pub(super) fn learn_views(&self, peer: &Member, stats: &serde_json::Value) {
        let views = match serde_json::from_value::<Vec<Vec<Member>>>(stats["cluster_views"].clone())
        {
            Ok(views) => views,
            Err(e) => {
                tracing::warn!(peer = %peer.id, error = %e, "a peer's cluster views did not parse; it may know brokers that journals left that this broker does not");
                return;
            }
        };
        let learned = self.topology.learn(views);
        if learned > 0 {
            metrics::add(&self.metrics.cluster_views_learned, learned as u64);
            tracing::info!(peer = %peer.id, learned, "learned cluster views from a peer");
        }
    }

    /// Takes a peer's specs and deletions that are newer than this
    /// broker's.
    pub(super) async fn adopt_newer(&self, peer: &str, entries: Vec<Listed>) {
        // Specs and tombstones are each taken in one change of the spec
        // store: one write of its file, however many a peer lists.
        let mut specs = Vec::new();
        let mut tombstones = Vec::new();
        for e in entries {
            if let Err(why) = crate::specs::check_revision(e.revision) {
                tracing::warn!(%peer, error = %why, "a peer listed a change no clock could have made; it is ignored");
                continue;
            }
            match (e.spec, e.deleted) {
                (Some(spec), None) => specs.push(crate::specs::Revised {
                    revision: e.revision,
                    spec,
                }),
                (None, Some(name)) => {
                    let ours = self.specs.get_revised(&name).map(|r| r.revision);
                    if ours.is_none_or(|r| r >= e.revision) {
                        // Not here, or created again after that deletion.
                        tombstones.push(crate::specs::Tombstone {
                            name,
                            revision: e.revision,
                        });
                        continue;
                    }
                    // The journal's own shard deletes it, files and all.
                    let owner = rotary_net::shard_of(&name, self.shards) as usize;
                    let payload = delete_payload(e.revision);
                    let res = crate::pipeline::unary(
                        self.endpoints[owner],
                        Op::DELETE,
                        rotary_net::wire::flag::LOCAL,
                        &rotary_net::wire::encode_name(&name),
                        &payload,
                        std::time::Duration::from_secs(5),
                    )
                    .await;
                    match res {
                        Ok((Status::OK, _, _)) => {
                            tracing::info!(%peer, journal = %name, "deleted a journal whose deletion this broker had missed")
                        }
                        other => {
                            tracing::warn!(%peer, journal = %name, outcome = ?other.map(|(s, _, _)| s), "deleting a journal whose deletion this broker had missed failed")
                        }
                    }
                }
                _ => {}
            }
        }
        if let Err(err) = self.specs.delete_each(tombstones) {
            tracing::warn!(%peer, error = %err, "recording a peer's deletions failed");
        }
        match self.specs.apply_each(specs) {
            Ok(adopted) if !adopted.is_empty() => {
                let shown = &adopted[..adopted.len().min(10)];
                tracing::info!(%peer, journals = ?shown, "adopted {} journal specs created or changed without this broker", adopted.len());
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(%peer, error = %err, "adopting a peer's journal specs failed")
            }
        }
    }
}

/// DELETE's payload from a peer broker (flag LOCAL): the deletion's
/// revision, `{"revision": N}`. Read back by [`parse_revision`].
pub(crate) fn delete_payload(revision: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "revision": revision })).expect("json")
}
