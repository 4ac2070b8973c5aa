//! What `status` and `check` read of the pool: its events, its hosts and cycles, one slot's
//! state, the schema and a host id already in use. Nothing here writes.

use anyhow::{Result, bail};

use crate::core::backoff::{Backoff, parse_backoff};
use crate::core::claims::Others;
use crate::core::holds::{Holds, parse_holds};
use crate::core::pool::PoolView;
use crate::core::state::{CycleState, parse_state};

use super::{POOL_READ, PgStore, PoolCycle, PoolRead, SCHEMA, VERSION};

impl PgStore {
    /// The pool's recent events, for `status`.
    pub fn events(&mut self, limit: i64) -> Result<Vec<String>> {
        let pool = self.me.pool.clone();
        let rows = self
            .client()?
            .query(
                "SELECT at::text, kind, host_id, coalesce(other_host, ''), coalesce(cycle_id, '')
                   FROM ci_ephemeral_provisioner.events WHERE pool = $1 ORDER BY id DESC LIMIT $2",
                &[&pool, &limit],
            )
            .map_err(|e| self.err("reading the pool's events", &e))?;
        Ok(rows
            .iter()
            .map(|r| {
                let (at, kind, host, other, cycle): (String, String, String, String, String) =
                    (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
                match kind.as_str() {
                    "adopted" => format!("{at} host {host} adopted cycle {cycle} of host {other}"),
                    _ => format!(
                        "{at} host {host} was fenced: its cycle {cycle} was adopted by host {other}"
                    ),
                }
            })
            .collect())
    }

    /// Reads the pool without renewing anything (`status`, `check`): the view, and the schema
    /// version. Creates nothing.
    pub fn inspect(&mut self) -> Result<(PoolView, i32)> {
        let sql = format!(
            "SELECT (SELECT version FROM ci_ephemeral_provisioner.schema_version), {POOL_READ}"
        );
        let (pool, host) = (self.me.pool.clone(), self.me.host.clone());
        let row = match self.client()?.query_one(sql.as_str(), &[&pool, &host]) {
            Ok(r) => r,
            // No tables yet: no run has made them, the pool has no host.
            Err(e)
                if e.code().is_some_and(|c| {
                    *c == postgres::error::SqlState::UNDEFINED_TABLE
                        || *c == postgres::error::SqlState::INVALID_SCHEMA_NAME
                }) =>
            {
                let view = PoolView {
                    pool,
                    ..PoolView::default()
                };
                return Ok((view, 0));
            }
            Err(e) => return Err(self.err("reading the pool", &e)),
        };
        let version: Option<i32> = row.get(0);
        self.check_version(version)?;
        self.pool_from(&row, 1)?;
        let mut view = self.view.clone().unwrap_or_default();
        view.events = self.events(10)?;
        Ok((view, version.unwrap_or(0)))
    }

    /// The pool as it is in the store, read without writing anything; `None` when no run has
    /// made the store's tables yet (nothing was ever stored).
    fn read_pool(&mut self) -> Result<Option<PoolRead>> {
        let sql = format!(
            "SELECT (SELECT version FROM ci_ephemeral_provisioner.schema_version), {POOL_READ}"
        );
        let (pool, host) = (self.me.pool.clone(), self.me.host.clone());
        let row = match self.client()?.query_one(sql.as_str(), &[&pool, &host]) {
            Ok(r) => r,
            Err(e)
                if e.code().is_some_and(|c| {
                    *c == postgres::error::SqlState::UNDEFINED_TABLE
                        || *c == postgres::error::SqlState::INVALID_SCHEMA_NAME
                }) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(self.err("reading the pool", &e)),
        };
        self.check_version(row.get(0))?;
        self.pool_from(&row, 1).map(Some)
    }

    /// This slot as it is in the pool store, read without writing anything (a dry-run): its
    /// cycle, its holds, the other slots, the backoff.
    pub fn read_slot(&mut self) -> Result<(Option<CycleState>, Holds, Others, Backoff)> {
        let Some((cycles, others, holds, backoff)) = self.read_pool()? else {
            return Ok((None, Holds::default(), Others::default(), Backoff::new()));
        };
        let state = cycles
            .iter()
            .find(|c| c.host == self.me.host && c.slot == self.me.k)
            .map(|c| parse_state(&c.state))
            .transpose()?;
        let holds = match holds {
            Some(t) => parse_holds(&t)?,
            None => Holds::default(),
        };
        let backoff = match backoff {
            Some(t) => parse_backoff(&t)?,
            None => Backoff::new(),
        };
        Ok((state, holds, others, backoff))
    }

    /// Every cycle of the pool, each with its host and slot, and what the sweep spares beside
    /// this slot, read without writing anything (`status --remote`).
    pub fn pool_cycles(&mut self) -> Result<(Vec<PoolCycle>, Others)> {
        let Some((cycles, others, _, _)) = self.read_pool()? else {
            return Ok((Vec::new(), Others::default()));
        };
        let states = cycles
            .iter()
            .map(|c| Ok((c.host.clone(), c.slot, parse_state(&c.state)?)))
            .collect::<Result<_>>()?;
        Ok((states, others))
    }

    /// `check`'s line: the database answers, its schema is one this build knows (or none yet),
    /// and this host id is live on no other machine. Writes nothing.
    pub fn check(&mut self) -> Result<String> {
        let pool = self.me.pool.clone();
        let host = self.me.host.clone();
        let row = self.client()?.query_one(
            "SELECT to_regclass('ci_ephemeral_provisioner.schema_version') IS NOT NULL",
            &[],
        );
        let exists: bool = row.map_err(|e| self.err("reading the schema", &e))?.get(0);
        if !exists {
            return Ok(format!(
                "PostgreSQL {} answers; no pool store there yet: the first run creates it (schema {SCHEMA}, version {VERSION})",
                self.spec.shown
            ));
        }
        let (view, version) = self.inspect()?;
        if let Some(holder) = self.host_conflict()? {
            bail!(
                "host id {host} of pool {pool} is live on another machine ({holder}): give each host its own --host-id"
            );
        }
        Ok(format!(
            "PostgreSQL {} answers, schema version {version}; pool {pool}: {} host(s), {} with a lapsed lease; host id {host} is live on no other machine",
            self.spec.shown,
            view.hosts.len(),
            view.hosts.iter().filter(|h| h.lapsed).count()
        ))
    }

    /// Whether this host id is live on another machine (`check`): its holder, if so.
    pub fn host_conflict(&mut self) -> Result<Option<String>> {
        let me = self.me.clone();
        let row = self
            .client()?
            .query_opt(
                "SELECT machine || ', lease until ' || lease_until::text
                   FROM ci_ephemeral_provisioner.hosts
                  WHERE pool = $1 AND host_id = $2 AND machine <> $3 AND lease_until > now()",
                &[&me.pool, &me.host, &me.machine],
            )
            .map_err(|e| self.err("reading the hosts", &e))?;
        Ok(row.map(|r| r.get(0)))
    }
}
