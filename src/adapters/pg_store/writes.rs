//! The statements of the store's writes, each run inside a transaction its caller holds: a
//! cycle and its claims, a new cycle, the backoff, the pool's lock, the warm VMs elsewhere.

use anyhow::{Result, anyhow};
use postgres::GenericClient;

use crate::core::backoff::{Backoff, parse_backoff};
use crate::core::pool::{claims_of, slot_name};
use crate::core::state::{CycleState, parse_state};
use crate::core::warm::is_unused_warm;

use super::{PoolSlot, SCHEMA, secs};

/// The derived claims of `state` as two arrays (job ids, handles; `""`: every attempt).
pub(super) fn claim_arrays(state: &CycleState) -> (Vec<i64>, Vec<String>) {
    claims_of(state)
        .into_iter()
        .map(|(j, h)| (j, h.unwrap_or_default()))
        .unzip()
}

/// Writes the cycle (`$1` pool, `$2` host, `$3` machine, `$4` lease seconds, `$5` cycle,
/// `$6` epoch, `$7` state, `$8` write id) if this host still owns it at this epoch, renewing
/// the lease; syncs its claims (`$9` forgejo, `$10` jobs, `$11` handles): new ones inserted
/// (one another cycle holds is left to it), those it no longer makes deleted. One statement.
pub(super) const SAVE: &str = "WITH h AS (UPDATE ci_ephemeral_provisioner.hosts
    SET lease_until = now() + make_interval(secs => $4), renewed_at = now()
    WHERE pool = $1 AND host_id = $2 AND machine = $3 RETURNING 1),
  c AS (UPDATE ci_ephemeral_provisioner.cycles SET state = $7, write_id = $8, updated_at = now()
    WHERE pool = $1 AND cycle_id = $5 AND epoch = $6 AND host_id = $2 AND EXISTS (SELECT 1 FROM h)
    RETURNING cycle_id),
  d AS (DELETE FROM ci_ephemeral_provisioner.claims k USING c
    WHERE k.pool = $1 AND k.cycle_id = c.cycle_id
      AND (k.job_id, k.handle) NOT IN (SELECT * FROM unnest($10::bigint[], $11::text[]))),
  i AS (INSERT INTO ci_ephemeral_provisioner.claims (forgejo, job_id, handle, pool, cycle_id)
    SELECT $9, j, hd, $1, c.cycle_id FROM c, unnest($10::bigint[], $11::text[]) AS t(j, hd)
    ON CONFLICT DO NOTHING)
  SELECT count(*) FROM c";

/// Inserts the claim of one attempt (`$1` forgejo, `$2` job, `$3` handle, `$4` pool, `$5`
/// cycle); no row when another cycle holds it.
pub(super) const CLAIM: &str =
    "INSERT INTO ci_ephemeral_provisioner.claims (forgejo, job_id, handle, pool, cycle_id)
    VALUES ($1, $2, $3, $4, $5)
    ON CONFLICT (forgejo, job_id, handle) DO UPDATE SET cycle_id = excluded.cycle_id
      WHERE claims.cycle_id = excluded.cycle_id AND claims.pool = excluded.pool
    RETURNING 1";

/// Who holds the claim of an attempt, in words.
pub(super) fn claimant(
    c: &mut impl GenericClient,
    me: &PoolSlot,
    job: i64,
    handle: &str,
) -> Result<String, postgres::Error> {
    let row = c.query_opt(
        "SELECT k.pool, k.cycle_id, coalesce(y.host_id, ''), coalesce(y.slot, 0)
           FROM ci_ephemeral_provisioner.claims k LEFT JOIN ci_ephemeral_provisioner.cycles y
             ON y.pool = k.pool AND y.cycle_id = k.cycle_id
          WHERE k.forgejo = $1 AND k.job_id = $2 AND k.handle = $3",
        &[&me.forgejo, &job, &handle],
    )?;
    Ok(match row {
        Some(r) => {
            let (pool, cycle, host, slot): (String, String, String, i32) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            if pool == me.pool {
                format!(
                    "{} (cycle {cycle})",
                    slot_name(&host, &me.host, slot as u32)
                )
            } else {
                format!("pool {pool} (cycle {cycle})")
            }
        }
        None => "another slot (its claim is gone again)".to_string(),
    })
}

pub(super) fn save_in(
    c: &mut impl GenericClient,
    me: &PoolSlot,
    mine: &(String, i64),
    state: &CycleState,
    id: &str,
) -> Result<bool, postgres::Error> {
    let text = serde_json::to_string(state).unwrap_or_default();
    let (jobs, handles) = claim_arrays(state);
    let n: i64 = c
        .query_one(
            SAVE,
            &[
                &me.pool,
                &me.host,
                &me.machine,
                &secs(me.lease),
                &mine.0,
                &mine.1,
                &text,
                &id,
                &me.forgejo,
                &jobs,
                &handles,
            ],
        )?
        .get(0);
    Ok(n == 1)
}

/// Inserts a new cycle of this slot (epoch 1); its claims are the caller's.
pub(super) fn insert_cycle(
    t: &mut impl GenericClient,
    me: &PoolSlot,
    state: &CycleState,
    id: &str,
) -> Result<(), postgres::Error> {
    let text = serde_json::to_string(state).unwrap_or_default();
    let k = me.k as i32;
    t.execute(
        "INSERT INTO ci_ephemeral_provisioner.cycles (pool, cycle_id, host_id, slot, epoch, state, write_id)
         VALUES ($1, $2, $3, $4, 1, $5, $6)",
        &[&me.pool, &state.cycle_id, &me.host, &k, &text, &id],
    )?;
    Ok(())
}

pub(super) fn read_backoff(t: &mut impl GenericClient, pool: &str) -> Result<Backoff> {
    let row = t
        .query_opt(
            "SELECT doc FROM ci_ephemeral_provisioner.backoff WHERE pool = $1",
            &[&pool],
        )
        .map_err(|e| anyhow!("reading the pool's failure backoff: {e}"))?;
    match row {
        None => Ok(Backoff::new()),
        Some(r) => parse_backoff(&r.get::<_, String>(0)).map_err(|e| {
            anyhow!(
                "the pool's failure backoff in the pool store is unusable: {e:#}; no new VM starts: delete its row ({SCHEMA}.backoff, pool {pool}) to clear it"
            )
        }),
    }
}

pub(super) fn write_backoff(
    t: &mut impl GenericClient,
    pool: &str,
    b: &Backoff,
) -> Result<(), postgres::Error> {
    let doc = serde_json::to_string(b).unwrap_or_default();
    t.execute(
        "INSERT INTO ci_ephemeral_provisioner.backoff (pool, doc) VALUES ($1, $2)
         ON CONFLICT (pool) DO UPDATE SET doc = excluded.doc",
        &[&pool, &doc],
    )?;
    Ok(())
}

/// The pool-wide lock of a start or an outcome (transaction-scoped: safe behind PgBouncer).
pub(super) fn lock_pool(t: &mut impl GenericClient, pool: &str) -> Result<(), postgres::Error> {
    t.execute(
        "SELECT pg_advisory_xact_lock(hashtext('ci-ephemeral-provisioner:' || $1))",
        &[&pool],
    )?;
    Ok(())
}

/// The other slots' unused warm VMs when they number `wanted` already (in words), else none.
pub(super) fn warm_elsewhere(
    t: &mut impl GenericClient,
    me: &PoolSlot,
    wanted: u32,
) -> Result<Option<String>, postgres::Error> {
    let rows = t.query(
        "SELECT host_id, slot, state FROM ci_ephemeral_provisioner.cycles WHERE pool = $1",
        &[&me.pool],
    )?;
    let mut warm = Vec::new();
    for r in rows {
        let (host, slot, text): (String, i32, String) = (r.get(0), r.get(1), r.get(2));
        let slot = slot as u32;
        if (host == me.host && (slot == me.k || slot > me.n))
            || !parse_state(&text).is_ok_and(|s| is_unused_warm(&s))
        {
            continue;
        }
        warm.push(slot_name(&host, &me.host, slot));
    }
    Ok((warm.len() as u32 >= wanted).then(|| format!("the warm VMs of {}", warm.join(", "))))
}
