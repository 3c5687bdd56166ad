//! Recovery logs: every file operation of a shard's embedded store,
//! recorded into a journal, so that playing the journal back rebuilds the
//! store's files byte for byte on another machine.
