//! The pool store on PostgreSQL (`--store pg`): one pool's cycles, claims, holds and failure
//! backoff for every host, with leases on the database's clock, adoption of a lapsed host's
//! cycles and fencing by epoch (`core::pool`). Every transaction is short: none is held open
//! across tofu, a launch or an HTTP request. The database down fails the operation (never a
//! fallback to files).
//!
//! An idle tick costs one statement: `load` renews the lease and reads the slot's cycle, its
//! holds, the other slots' claims, the hosts and the backoff at once; the `load_holds` and the
//! first `others` (the first observation) that follow it are answered from that read, unless a
//! write came first.

mod conn;
mod renewer;
mod schema;
mod views;
mod writes;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;

pub use conn::{ConnSpec, PG_CONN_STR, SslMode};
pub use schema::{SCHEMA, VERSION};

use renewer::Renewer;
use writes::{
    CLAIM, claimant, insert_cycle, lock_pool, read_backoff, save_in, warm_elsewhere, write_backoff,
};

use crate::core::backoff::{Backoff, Change, CycleOutcome, Gate, parse_backoff};
use crate::core::claims::Others;
use crate::core::holds::{Holds, HoldsError, parse_holds};
use crate::core::pool::{
    Adoption, Fenced, HostView, PoolView, adopted_state, claims_of, slot_name,
};
use crate::core::ports::{BackoffGate, Claim, Start, StateStore};
use crate::core::state::{CycleState, parse_state};

/// Every statement ends within this (`statement_timeout`); an open transaction left idle twice
/// as long is ended by the server.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Who this store is: the pool, the host (its id and the machine it runs on), the slot.
#[derive(Clone, Debug)]
pub struct PoolSlot {
    pub pool: String,
    pub host: String,
    /// `hostname machine-id state-dir`: another machine (or another state directory) with the
    /// same host id is another host.
    pub machine: String,
    /// The Forgejo whose job attempts are claimed (one claim per attempt per Forgejo).
    pub forgejo: String,
    pub k: u32,
    pub n: u32,
    pub lease: Duration,
}

/// The pool store of one slot of one host.
pub struct PgStore {
    spec: Arc<ConnSpec>,
    me: PoolSlot,
    client: Option<postgres::Client>,
    /// The cycle this slot owns, and its epoch.
    mine: Option<(String, i64)>,
    /// What `load` read, for the reads right after it.
    snap: Option<Snapshot>,
    adopted: Option<Adoption>,
    view: Option<PoolView>,
    renewer: Option<Renewer>,
    /// Start the lease renewer at the first `load` (`run`; not `status` or `check`).
    renew: bool,
}

struct Snapshot {
    holds: Option<String>,
    others: Others,
    others_left: u8,
}

static WRITES: AtomicU64 = AtomicU64::new(0);

#[derive(Deserialize)]
struct CycleRow {
    cycle_id: String,
    host: String,
    slot: u32,
    epoch: i64,
    state: String,
    lapsed: bool,
}

#[derive(Deserialize)]
struct HoldsRow {
    host: String,
    slot: u32,
    holds: String,
}

#[derive(Deserialize)]
struct HostRow {
    host: String,
    ago: i64,
    lapsed: bool,
}

/// A cycle of the pool: its host, its slot, its state.
pub type PoolCycle = (String, u32, CycleState);

/// What `pool_from` reads: every cycle row, the other slots' claims, this slot's holds and the
/// pool's backoff (their JSON texts).
type PoolRead = (Vec<CycleRow>, Others, Option<String>, Option<String>);

/// The pool as one statement reads it (`$1` pool, `$2` host): every cycle (with whether its
/// owner's lease lapsed), the holds of live hosts' slots, the hosts, the backoff.
const POOL_READ: &str = "
  (SELECT coalesce(json_agg(json_build_object('cycle_id', c.cycle_id, 'host', c.host_id,
      'slot', c.slot, 'epoch', c.epoch, 'state', c.state,
      'lapsed', coalesce(o.lease_until < now(), true)) ORDER BY c.host_id, c.slot)::text, '[]')
     FROM ci_ephemeral_provisioner.cycles c LEFT JOIN ci_ephemeral_provisioner.hosts o
       ON o.pool = c.pool AND o.host_id = c.host_id WHERE c.pool = $1) AS cycles,
  (SELECT coalesce(json_agg(json_build_object('host', s.host_id, 'slot', s.slot,
      'holds', s.holds))::text, '[]')
     FROM ci_ephemeral_provisioner.slots s JOIN ci_ephemeral_provisioner.hosts o
       ON o.pool = s.pool AND o.host_id = s.host_id
     WHERE s.pool = $1 AND (o.lease_until > now() OR s.host_id = $2)) AS holds,
  (SELECT coalesce(json_agg(json_build_object('host', host_id,
      'ago', extract(epoch FROM now() - renewed_at)::bigint,
      'lapsed', lease_until < now()) ORDER BY host_id)::text, '[]')
     FROM ci_ephemeral_provisioner.hosts WHERE pool = $1) AS hosts,
  (SELECT doc FROM ci_ephemeral_provisioner.backoff WHERE pool = $1) AS backoff";

/// Renews the lease of this host (`$1` pool, `$2` host, `$3` machine, `$4` seconds), as a CTE.
const RENEW: &str = "h AS (UPDATE ci_ephemeral_provisioner.hosts
    SET lease_until = now() + make_interval(secs => $4), renewed_at = now()
    WHERE pool = $1 AND host_id = $2 AND machine = $3 RETURNING 1)";

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl PgStore {
    /// The store of slot `me.k` of host `me.host`. Connects at its first use. `renew`: keep the
    /// lease renewed in the background from the first `load` on (a `run`).
    pub fn new(spec: ConnSpec, me: PoolSlot, renew: bool) -> PgStore {
        PgStore {
            spec: Arc::new(spec),
            me,
            client: None,
            mine: None,
            snap: None,
            adopted: None,
            view: None,
            renewer: None,
            renew,
        }
    }

    /// `user@host:port/db`.
    /// The pool this store serves (`--pool`).
    pub fn pool(&self) -> &str {
        &self.me.pool
    }

    pub fn shown(&self) -> &str {
        &self.spec.shown
    }

    fn err(&self, what: &str, e: &postgres::Error) -> anyhow::Error {
        let detail = match e.as_db_error() {
            Some(db) => format!("{}: {}", db.severity(), db.message()),
            None => e.to_string(),
        };
        anyhow!(
            "{what} in PostgreSQL {} failed: {}; the database must be reachable for --store pg (nothing falls back to files)",
            self.spec.shown,
            self.spec.scrub(&detail)
        )
    }

    fn client(&mut self) -> Result<&mut postgres::Client> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = None;
            let c = self
                .spec
                .connect("ci-ephemeral-provisioner", STATEMENT_TIMEOUT)?;
            self.client = Some(c);
        }
        Ok(self.client.as_mut().expect("just connected"))
    }

    /// Whether the connection was lost (the outcome of what was in flight is unknown).
    fn lost(&self) -> bool {
        self.client.as_ref().is_none_or(|c| c.is_closed())
    }

    fn write_id(&self) -> String {
        format!(
            "{}-{}-{}",
            self.me.host,
            std::process::id(),
            WRITES.fetch_add(1, Ordering::SeqCst)
        )
    }

    /// `load`'s statement: renew the lease (refused when another machine holds this host id
    /// live), then read the pool. Creates the schema when there is none.
    fn begin(&mut self) -> Result<postgres::Row> {
        let sql = format!(
            "WITH h AS (INSERT INTO ci_ephemeral_provisioner.hosts AS x
                 (pool, host_id, machine, lease_until, renewed_at)
               VALUES ($1, $2, $3, now() + make_interval(secs => $4), now())
               ON CONFLICT (pool, host_id) DO UPDATE
                 SET lease_until = excluded.lease_until, renewed_at = now(), machine = excluded.machine
                 WHERE x.machine = excluded.machine OR x.lease_until < now()
               RETURNING 1)
             SELECT (SELECT version FROM ci_ephemeral_provisioner.schema_version) AS version,
               EXISTS (SELECT 1 FROM h) AS renewed,
               (SELECT machine || ', lease until ' || lease_until::text
                  FROM ci_ephemeral_provisioner.hosts WHERE pool = $1 AND host_id = $2) AS holder,
               {POOL_READ}"
        );
        let me = self.me.clone();
        let lease = secs(me.lease);
        for attempt in 0..2 {
            let r = self
                .client()?
                .query_one(sql.as_str(), &[&me.pool, &me.host, &me.machine, &lease]);
            match r {
                Ok(row) => return Ok(row),
                Err(e)
                    if attempt == 0
                        && e.code().is_some_and(|c| {
                            *c == postgres::error::SqlState::UNDEFINED_TABLE
                                || *c == postgres::error::SqlState::INVALID_SCHEMA_NAME
                        }) =>
                {
                    self.create_schema()?;
                }
                Err(e) if attempt == 0 && self.lost() => {
                    log::warn!("{}; connecting again", self.err("reading the pool", &e));
                }
                Err(e) => return Err(self.err("reading the pool", &e)),
            }
        }
        Err(anyhow!(
            "{} in PostgreSQL {} failed twice",
            "reading the pool",
            self.spec.shown
        ))
    }

    fn create_schema(&mut self) -> Result<()> {
        log::info!(
            "creating the pool store's tables (schema {SCHEMA}, version {VERSION}) in PostgreSQL {}",
            self.spec.shown
        );
        let c = self.client()?;
        let r = c
            .transaction()
            .and_then(|mut t| t.batch_execute(schema::CREATE).and_then(|()| t.commit()));
        r.map_err(|e| self.err("creating the schema", &e))
    }

    fn check_version(&self, v: Option<i32>) -> Result<()> {
        match v {
            Some(v) if v > VERSION => bail!(
                "the pool store in PostgreSQL {} has schema version {v}, newer than this build's {VERSION}: upgrade ci-ephemeral-provisioner on this host (a binary never writes a schema it does not know)",
                self.spec.shown
            ),
            Some(_) => Ok(()),
            None => bail!(
                "the pool store in PostgreSQL {} has no schema version row: was {SCHEMA}.schema_version emptied by hand?",
                self.spec.shown
            ),
        }
    }

    /// The other slots' claims, holds, names and warm VMs, from the pool's cycles and holds.
    fn others_from(&self, cycles: &[CycleRow], holds: &[HoldsRow]) -> Result<Others> {
        let me = &self.me;
        let mut o = Others::default();
        for c in cycles {
            if c.host == me.host && c.slot == me.k {
                continue;
            }
            let state = parse_state(&c.state).with_context(|| {
                format!(
                    "cycle {} of {} in the pool store cannot be read, so what it holds is unknown",
                    c.cycle_id,
                    slot_name(&c.host, &me.host, c.slot)
                )
            })?;
            let name = format!(
                "{} (cycle {})",
                slot_name(&c.host, &me.host, c.slot),
                c.cycle_id
            );
            if c.host == me.host && c.slot > me.n {
                o.beyond.push(format!(
                    "{name} is in progress, but this host has --slots {} now: its VM and registrations stay until it finishes; run that slot (--slots {} --slot {}) until it does, or raise --slots again",
                    me.n, c.slot, c.slot
                ));
            }
            o.add(c.slot, &c.host, &name, &state);
            if c.host == me.host && c.slot > me.n {
                o.warm.remove(&(c.slot, c.host.clone()));
            }
        }
        for h in holds {
            if h.host == me.host && h.slot == me.k {
                continue;
            }
            match parse_holds(&h.holds) {
                Ok(x) => {
                    o.held
                        .extend(x.jobs.iter().map(|j| (j.handle.clone(), j.until)));
                    o.add_seen(&x.seen);
                }
                Err(e) => log::warn!(
                    "the held jobs of {} cannot be read ({e:#}); they are not known here",
                    slot_name(&h.host, &me.host, h.slot)
                ),
            }
        }
        Ok(o)
    }

    /// The pool read from its columns (`POOL_READ`, starting at column `at`).
    fn pool_from(&mut self, row: &postgres::Row, at: usize) -> Result<PoolRead> {
        let cycles: Vec<CycleRow> = serde_json::from_str(&row.get::<_, String>(at))?;
        let holds: Vec<HoldsRow> = serde_json::from_str(&row.get::<_, String>(at + 1))?;
        let hosts: Vec<HostRow> = serde_json::from_str(&row.get::<_, String>(at + 2))?;
        let backoff: Option<String> = row.get(at + 3);
        let others = self.others_from(&cycles, &holds)?;
        let my_holds = holds
            .iter()
            .find(|h| h.host == self.me.host && h.slot == self.me.k)
            .map(|h| h.holds.clone());
        self.view = Some(PoolView {
            pool: self.me.pool.clone(),
            hosts: hosts
                .into_iter()
                .map(|h| HostView {
                    cycles: cycles
                        .iter()
                        .filter(|c| c.host == h.host)
                        .map(|c| format!("slot {}: cycle {}", c.slot, c.cycle_id))
                        .collect(),
                    host_id: h.host,
                    renewed_seconds_ago: h.ago,
                    lapsed: h.lapsed,
                })
                .collect(),
            events: Vec::new(),
            backoff: backoff.as_deref().and_then(|b| parse_backoff(b).ok()),
        });
        Ok((cycles, others, my_holds, backoff))
    }

    /// Adopts one cycle whose owner's lease lapsed into this slot (which has none): a new epoch,
    /// torn down from now on. `None` when another host was first, or the owner renewed.
    fn adopt(&mut self) -> Result<Option<CycleState>> {
        let me = self.me.clone();
        let id = self.write_id();
        let spec = self.spec.clone();
        let c = self.client()?;
        let mut t = c
            .transaction()
            .map_err(|e| anyhow!("adopting a cycle: {}", spec.scrub(&e.to_string())))?;
        // The owner's host row locked (its lease read as it is now), or skipped while the owner
        // renews it.
        let row = t.query_opt(
            "SELECT c.cycle_id, c.host_id, c.slot, c.epoch, c.state, o.lease_until::text
               FROM ci_ephemeral_provisioner.cycles c JOIN ci_ephemeral_provisioner.hosts o
                 ON o.pool = c.pool AND o.host_id = c.host_id
              WHERE c.pool = $1 AND c.host_id <> $2 AND o.lease_until < now()
              ORDER BY c.updated_at LIMIT 1 FOR UPDATE OF o, c SKIP LOCKED",
            &[&me.pool, &me.host],
        );
        let Some(row) =
            row.map_err(|e| anyhow!("adopting a cycle: {}", spec.scrub(&e.to_string())))?
        else {
            return Ok(None);
        };
        let (cycle_id, from, slot, epoch, text, lapsed): (
            String,
            String,
            i32,
            i64,
            String,
            String,
        ) = (
            row.get(0),
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
            row.get(5),
        );
        let state = parse_state(&text).with_context(|| {
            format!("cycle {cycle_id} of host {from} (lease lapsed) cannot be read, so it cannot be adopted")
        })?;
        let a = Adoption {
            cycle_id: cycle_id.clone(),
            from_host: from.clone(),
            from_slot: slot as u32,
            lapsed_at: lapsed,
        };
        let state = adopted_state(state, &a);
        let text = serde_json::to_string(&state).context("cannot encode the adopted cycle")?;
        let k = me.k as i32;
        let n = t
            .execute(
                "UPDATE ci_ephemeral_provisioner.cycles
                    SET host_id = $3, slot = $4, epoch = epoch + 1, adopted_from = host_id,
                        adopted_at = now(), state = $5, write_id = $6, updated_at = now()
                  WHERE pool = $1 AND cycle_id = $2 AND epoch = $7",
                &[&me.pool, &cycle_id, &me.host, &k, &text, &id, &epoch],
            )
            .and_then(|n| {
                t.execute(
                    "INSERT INTO ci_ephemeral_provisioner.events (pool, kind, host_id, other_host, cycle_id)
                     VALUES ($1, 'adopted', $2, $3, $4)",
                    &[&me.pool, &me.host, &from, &cycle_id],
                )
                .map(|_| n)
            })
            .and_then(|n| t.commit().map(|()| n))
            .map_err(|e| anyhow!("adopting cycle {cycle_id}: {}", spec.scrub(&e.to_string())))?;
        if n != 1 {
            return Ok(None);
        }
        self.mine = Some((cycle_id, epoch + 1));
        self.adopted = Some(a);
        Ok(Some(state))
    }

    /// Why a write of the cycle changed nothing: it was adopted (or is gone).
    fn fenced(&mut self, cycle_id: &str) -> anyhow::Error {
        let me = self.me.clone();
        let found = self.client().ok().and_then(|c| {
            let by = c
                .query_opt(
                    "SELECT host_id, coalesce(adopted_at::text, '') FROM ci_ephemeral_provisioner.cycles
                      WHERE pool = $1 AND cycle_id = $2",
                    &[&me.pool, &cycle_id],
                )
                .ok()?;
            let by = match by {
                Some(r) => Some((r.get::<_, String>(0), r.get::<_, String>(1))),
                None => c
                    .query_opt(
                        "SELECT host_id, at::text FROM ci_ephemeral_provisioner.events
                          WHERE pool = $1 AND cycle_id = $2 AND kind = 'adopted' ORDER BY id DESC LIMIT 1",
                        &[&me.pool, &cycle_id],
                    )
                    .ok()?
                    .map(|r| (r.get(0), r.get(1))),
            };
            let _ = c.execute(
                "INSERT INTO ci_ephemeral_provisioner.events (pool, kind, host_id, other_host, cycle_id)
                 VALUES ($1, 'fenced', $2, $3, $4)",
                &[&me.pool, &me.host, &by.as_ref().map(|b| b.0.clone()), &cycle_id],
            );
            by
        });
        let f = Fenced {
            cycle_id: cycle_id.to_string(),
            by: found.as_ref().map(|b| b.0.clone()),
            at: found.map(|b| b.1).filter(|a| !a.is_empty()),
        };
        log::error!("{f}");
        anyhow::Error::new(f)
    }

    fn mine(&self, state_id: &str) -> Result<(String, i64)> {
        match &self.mine {
            Some((id, e)) if id == state_id => Ok((id.clone(), *e)),
            Some((id, _)) => bail!(
                "internal error: slot {} of host {} owns cycle {id}, not {state_id}",
                self.me.k,
                self.me.host
            ),
            None => bail!(
                "internal error: cycle {state_id} was never started in the pool store by slot {} of host {}",
                self.me.k,
                self.me.host
            ),
        }
    }

    /// Runs `write` (a transaction on a fresh write id); when the connection was lost on the
    /// way, reads back whether it committed (`committed`), and tries once more if it did not.
    fn write<T>(
        &mut self,
        what: &str,
        write: impl Fn(&mut postgres::Client, &PoolSlot, &str) -> Result<T, postgres::Error>,
        committed: impl Fn(&mut postgres::Client, &PoolSlot, &str) -> Result<Option<T>, postgres::Error>,
    ) -> Result<T> {
        self.snap = None;
        let me = self.me.clone();
        for attempt in 0..2 {
            let id = self.write_id();
            let r = write(self.client()?, &me, &id);
            match r {
                Ok(t) => return Ok(t),
                Err(e) if attempt == 0 && self.lost() => {
                    log::warn!(
                        "{}; the outcome is unknown: reading it back",
                        self.err(what, &e)
                    );
                    let c = self.client()?;
                    match committed(c, &me, &id) {
                        Ok(Some(t)) => return Ok(t),
                        Ok(None) => continue,
                        Err(e) => return Err(self.err(what, &e)),
                    }
                }
                Err(e) => return Err(self.err(what, &e)),
            }
        }
        Err(anyhow!(
            "{what} in PostgreSQL {} failed twice",
            self.spec.shown
        ))
    }

    fn start_renewer(&mut self) {
        if self.renew && self.renewer.is_none() {
            self.renewer = Some(Renewer::start(self.spec.clone(), self.me.clone()));
        }
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        if let Some(r) = self.renewer.take() {
            r.stop();
        }
    }
}

/// What a start decided inside its transaction.
enum Started {
    Saved,
    Refused(Start),
}

impl StateStore for PgStore {
    fn load(&mut self) -> Result<Option<CycleState>> {
        let row = self.begin()?;
        self.check_version(row.get(0))?;
        let renewed: bool = row.get(1);
        if !renewed {
            let holder: Option<String> = row.get(2);
            bail!(
                "host id {} of pool {} is live on another machine ({}): two hosts with one --host-id are refused; give each host its own (the default is the host name), or wait until that lease lapses",
                self.me.host,
                self.me.pool,
                holder.unwrap_or_default()
            );
        }
        let (cycles, others, holds, _) = self.pool_from(&row, 3)?;
        self.start_renewer();
        let own = cycles
            .iter()
            .find(|c| c.host == self.me.host && c.slot == self.me.k);
        let state = match own {
            Some(c) => {
                let s = parse_state(&c.state).map_err(|e| {
                    anyhow!(
                        "cycle {} of slot {} in the pool store is unusable: {e:#}; it was left as it is and nothing else was done",
                        c.cycle_id,
                        self.me.k
                    )
                })?;
                self.mine = Some((c.cycle_id.clone(), c.epoch));
                Some(s)
            }
            None => None,
        };
        let lapsed = cycles.iter().any(|c| c.lapsed && c.host != self.me.host);
        // Only a `run` adopts (a `sweep` would leave the adopted cycle to the next run).
        if state.is_none() && lapsed && self.renew {
            // Adopted into this slot: the reads that follow see the pool as it is now.
            return self.adopt();
        }
        self.snap = Some(Snapshot {
            holds,
            others,
            others_left: 1,
        });
        Ok(state)
    }

    fn save(&mut self, state: &CycleState) -> Result<()> {
        let mine = self.mine(&state.cycle_id)?;
        let ok = self.write(
            "writing the cycle",
            |c, me, id| save_in(c, me, &mine, state, id),
            |c, me, id| {
                let r = c.query_opt(
                    "SELECT 1 FROM ci_ephemeral_provisioner.cycles WHERE pool = $1 AND cycle_id = $2 AND write_id = $3",
                    &[&me.pool, &mine.0, &id],
                );
                r.map(|r| r.map(|_| true))
            },
        );
        match ok {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.fenced(&mine.0)),
            Err(e) => Err(e),
        }
    }

    fn remove(&mut self) -> Result<()> {
        let Some(mine) = self.mine.clone() else {
            return Ok(());
        };
        let n = self.write(
            "removing the cycle",
            |c, me, _| {
                c.execute(
                    "DELETE FROM ci_ephemeral_provisioner.cycles
                      WHERE pool = $1 AND cycle_id = $2 AND epoch = $3 AND host_id = $4",
                    &[&me.pool, &mine.0, &mine.1, &me.host],
                )
            },
            |c, me, _| {
                let r = c.query_opt(
                    "SELECT 1 FROM ci_ephemeral_provisioner.cycles WHERE pool = $1 AND cycle_id = $2",
                    &[&me.pool, &mine.0],
                )?;
                Ok(r.is_none().then_some(1))
            },
        )?;
        if n == 0 {
            // Gone already, or adopted: either way not ours.
            let pool = self.me.pool.clone();
            let still: Option<String> = self
                .client()?
                .query_opt(
                    "SELECT host_id FROM ci_ephemeral_provisioner.cycles WHERE pool = $1 AND cycle_id = $2",
                    &[&pool, &mine.0],
                )
                .map_err(|e| anyhow!("{}", self.spec.scrub(&e.to_string())))?
                .map(|r| r.get(0));
            if still.is_some() {
                return Err(self.fenced(&mine.0));
            }
        }
        self.mine = None;
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "the pool store (PostgreSQL {}, pool {}, slot {} of host {})",
            self.spec.shown, self.me.pool, self.me.k, self.me.host
        )
    }

    fn load_holds(&mut self) -> Result<Holds, HoldsError> {
        let text = match self.snap.as_mut().map(|s| s.holds.take()) {
            Some(t) => t,
            None => {
                let me = self.me.clone();
                let k = me.k as i32;
                let c = self
                    .client()
                    .map_err(|e| HoldsError::Unreadable(format!("{e:#}")))?;
                c.query_opt(
                    "SELECT holds FROM ci_ephemeral_provisioner.slots WHERE pool = $1 AND host_id = $2 AND slot = $3",
                    &[&me.pool, &me.host, &k],
                )
                .map_err(|e| HoldsError::Unreadable(self.err("reading the held jobs", &e).to_string()))?
                .map(|r| r.get(0))
            }
        };
        match text {
            None => Ok(Holds::default()),
            Some(t) => parse_holds(&t).map_err(|e| {
                HoldsError::Unusable(format!(
                    "the held jobs of slot {} in the pool store are unusable: {e:#}",
                    self.me.k
                ))
            }),
        }
    }

    fn save_holds(&mut self, holds: &Holds) -> Result<()> {
        let me = self.me.clone();
        let k = me.k as i32;
        let doc = serde_json::to_string(holds).context("cannot encode the held jobs")?;
        let r = if holds.is_empty() {
            self.client()?.execute(
                "DELETE FROM ci_ephemeral_provisioner.slots WHERE pool = $1 AND host_id = $2 AND slot = $3",
                &[&me.pool, &me.host, &k],
            )
        } else {
            self.client()?.execute(
                "INSERT INTO ci_ephemeral_provisioner.slots (pool, host_id, slot, holds) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (pool, host_id, slot) DO UPDATE SET holds = excluded.holds",
                &[&me.pool, &me.host, &k, &doc],
            )
        };
        r.map(|_| ())
            .map_err(|e| self.err("writing the held jobs", &e))
    }

    fn others(&mut self) -> Result<Others> {
        if let Some(s) = &mut self.snap
            && s.others_left > 0
        {
            s.others_left -= 1;
            return Ok(s.others.clone());
        }
        self.snap = None;
        let sql = format!("SELECT {POOL_READ}");
        let (pool, host) = (self.me.pool.clone(), self.me.host.clone());
        let row = self
            .client()?
            .query_one(sql.as_str(), &[&pool, &host])
            .map_err(|e| self.err("reading the other slots' claims", &e))?;
        Ok(self.pool_from(&row, 0)?.1)
    }

    fn save_claiming(&mut self, state: &CycleState, job_id: i64, handle: &str) -> Result<Claim> {
        let mine = self.mine(&state.cycle_id)?;
        let r = self.write(
            "claiming a job",
            |c, me, id| {
                let mut t = c.transaction()?;
                let got = t.query_opt(CLAIM, &[&me.forgejo, &job_id, &handle, &me.pool, &mine.0])?;
                if got.is_none() {
                    let by = claimant(&mut t, me, job_id, handle)?;
                    return Ok(Some(Claim::HeldBy(by)));
                }
                if !save_in(&mut t, me, &mine, state, id)? {
                    return Ok(None);
                }
                t.commit()?;
                Ok(Some(Claim::Saved))
            },
            |c, me, id| {
                let r = c.query_opt(
                    "SELECT 1 FROM ci_ephemeral_provisioner.cycles WHERE pool = $1 AND cycle_id = $2 AND write_id = $3",
                    &[&me.pool, &mine.0, &id],
                )?;
                Ok(r.map(|_| Some(Claim::Saved)))
            },
        )?;
        match r {
            Some(c) => Ok(c),
            None => Err(self.fenced(&mine.0)),
        }
    }

    fn load_backoff(&mut self) -> Result<Backoff> {
        let pool = self.me.pool.clone();
        read_backoff(self.client()?, &pool)
    }

    fn save_backoff(&mut self, backoff: &Backoff) -> Result<()> {
        let pool = self.me.pool.clone();
        write_backoff(self.client()?, &pool, backoff)
            .map_err(|e| self.err("writing the failure backoff", &e))
    }

    fn save_starting(
        &mut self,
        state: &CycleState,
        _job_id: i64,
        _handle: &str,
        gate: &BackoffGate,
    ) -> Result<Start> {
        // The claim (`state.claim`) is inserted with the cycle, before the backoff's gate: a job
        // another slot holds costs no backoff.
        self.start(state, gate, None)
    }

    fn save_starting_warm(
        &mut self,
        state: &CycleState,
        wanted: u32,
        gate: &BackoffGate,
    ) -> Result<Start> {
        self.start(state, gate, Some(wanted))
    }

    fn record_outcome(
        &mut self,
        gate: &BackoffGate,
        cycle_id: &str,
        outcome: CycleOutcome,
    ) -> Result<(Backoff, Change)> {
        let mine = self.mine(cycle_id)?;
        let policy = gate.policy;
        let (slot, now) = (gate.slot, gate.now);
        let r = self.write(
            "counting the cycle in the failure backoff",
            |c, me, _| {
                let mut t = c.transaction()?;
                lock_pool(&mut t, &me.pool)?;
                let row = t.query_opt(
                    "SELECT counted FROM ci_ephemeral_provisioner.cycles
                      WHERE pool = $1 AND cycle_id = $2 AND epoch = $3 AND host_id = $4 FOR UPDATE",
                    &[&me.pool, &mine.0, &mine.1, &me.host],
                )?;
                let Some(row) = row else {
                    return Ok(None);
                };
                let b = match read_backoff(&mut t, &me.pool) {
                    Ok(b) => b,
                    Err(e) => return Ok(Some(Err(e))),
                };
                if row.get::<_, bool>(0) || !policy.enabled() {
                    return Ok(Some(Ok((b, Change::Unchanged))));
                }
                let (b, change) = b.record(&policy, slot, &mine.0, outcome, now);
                if change != Change::Unchanged {
                    write_backoff(&mut t, &me.pool, &b)?;
                }
                t.execute(
                    "UPDATE ci_ephemeral_provisioner.cycles SET counted = true WHERE pool = $1 AND cycle_id = $2",
                    &[&me.pool, &mine.0],
                )?;
                t.commit()?;
                Ok(Some(Ok((b, change))))
            },
            |c, me, _| {
                let r = c.query_opt(
                    "SELECT counted FROM ci_ephemeral_provisioner.cycles WHERE pool = $1 AND cycle_id = $2",
                    &[&me.pool, &mine.0],
                )?;
                Ok(match r {
                    Some(r) if r.get::<_, bool>(0) => Some(Some(Ok((Backoff::new(), Change::Unchanged)))),
                    _ => None,
                })
            },
        )?;
        match r {
            Some(r) => r,
            None => Err(self.fenced(&mine.0)),
        }
    }

    fn guard(&mut self, step: &str) -> Result<()> {
        self.snap = None;
        let me = self.me.clone();
        let lease = secs(me.lease);
        let mine = self.mine.clone();
        let r = match &mine {
            Some((id, epoch)) => self.client()?.query_opt(
                format!(
                    "WITH {RENEW} UPDATE ci_ephemeral_provisioner.cycles SET updated_at = now()
                      WHERE pool = $1 AND cycle_id = $5 AND epoch = $6 AND host_id = $2
                        AND EXISTS (SELECT 1 FROM h) RETURNING 1"
                )
                .as_str(),
                &[&me.pool, &me.host, &me.machine, &lease, id, epoch],
            ),
            None => self.client()?.query_opt(
                format!("WITH {RENEW} SELECT 1 FROM h").as_str(),
                &[&me.pool, &me.host, &me.machine, &lease],
            ),
        };
        match r {
            Ok(Some(_)) => Ok(()),
            Ok(None) => match mine {
                Some((id, _)) => Err(self.fenced(&id)),
                None => bail!(
                    "host id {} of pool {} is now held by another machine: not going on with {step}",
                    me.host,
                    me.pool
                ),
            },
            Err(e) => Err(self.err(&format!("renewing the lease before {step}"), &e)),
        }
    }

    fn adopted(&mut self) -> Option<Adoption> {
        self.adopted.take()
    }

    fn pool_view(&mut self) -> Option<PoolView> {
        self.view.clone()
    }
}

impl PgStore {
    /// A new cycle of this slot, in one transaction under the pool's lock: the cycle and its
    /// claims (refused when another cycle holds one), then (a warm VM) the count of the pool's
    /// unused warm VMs, then the failure backoff's gate (a retry re-arms it).
    fn start(
        &mut self,
        state: &CycleState,
        gate: &BackoffGate,
        warm: Option<u32>,
    ) -> Result<Start> {
        let cycle_id = state.cycle_id.clone();
        let r = self.write(
            "starting a cycle",
            |c, me, id| {
                let mut t = c.transaction()?;
                lock_pool(&mut t, &me.pool)?;
                insert_cycle(&mut t, me, state, id)?;
                for (job, handle) in claims_of(state) {
                    let handle = handle.unwrap_or_default();
                    if t.query_opt(CLAIM, &[&me.forgejo, &job, &handle, &me.pool, &cycle_id])?
                        .is_none()
                    {
                        let by = claimant(&mut t, me, job, &handle)?;
                        return Ok(Ok(Started::Refused(Start::Claim(Claim::HeldBy(by)))));
                    }
                }
                if let Some(wanted) = warm
                    && let Some(by) = warm_elsewhere(&mut t, me, wanted)?
                {
                    return Ok(Ok(Started::Refused(Start::Claim(Claim::HeldBy(by)))));
                }
                if gate.policy.enabled() {
                    let b = match read_backoff(&mut t, &me.pool) {
                        Ok(b) => b,
                        Err(e) => return Ok(Err(e)),
                    };
                    match b.gate(&gate.policy, gate.now) {
                        Gate::Closed(c) => return Ok(Ok(Started::Refused(Start::BackingOff(c)))),
                        Gate::Open => {}
                        Gate::Retry(armed) => write_backoff(&mut t, &me.pool, &armed)?,
                    }
                }
                t.commit()?;
                Ok(Ok(Started::Saved))
            },
            |c, me, id| {
                let r = c.query_opt(
                    "SELECT 1 FROM ci_ephemeral_provisioner.cycles WHERE pool = $1 AND cycle_id = $2 AND write_id = $3",
                    &[&me.pool, &cycle_id, &id],
                )?;
                Ok(r.map(|_| Ok(Started::Saved)))
            },
        )??;
        match r {
            Started::Saved => {
                self.mine = Some((cycle_id, 1));
                Ok(Start::Claim(Claim::Saved))
            }
            Started::Refused(s) => Ok(s),
        }
    }
}
