//! The tables of the pool store, versioned. A binary creates the schema it knows when there is
//! none, and refuses a database whose schema is newer than it knows.

/// The schema of our tables (apart from tofu's, whatever `PG_SCHEMA_NAME` says).
pub const SCHEMA: &str = "ci_ephemeral_provisioner";

/// The version of the tables this build reads and writes.
pub const VERSION: i32 = 1;

/// Creates version 1 (every statement idempotent), under an advisory lock (transaction-scoped:
/// safe behind PgBouncer) that serializes hosts creating it at once.
pub const CREATE: &str = r#"
SELECT pg_advisory_xact_lock(109304324554753);
CREATE SCHEMA IF NOT EXISTS ci_ephemeral_provisioner;
CREATE TABLE IF NOT EXISTS ci_ephemeral_provisioner.schema_version (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    version integer NOT NULL
);
INSERT INTO ci_ephemeral_provisioner.schema_version (version) VALUES (1) ON CONFLICT DO NOTHING;
-- One row per host of a pool: its lease, on the database's clock.
CREATE TABLE IF NOT EXISTS ci_ephemeral_provisioner.hosts (
    pool text NOT NULL,
    host_id text NOT NULL,
    machine text NOT NULL,
    lease_until timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL,
    PRIMARY KEY (pool, host_id)
);
-- The cycles of the pool (what cycle.json holds with the files store), each owned by one slot of
-- one host under an epoch; every write is conditional on it.
CREATE TABLE IF NOT EXISTS ci_ephemeral_provisioner.cycles (
    pool text NOT NULL,
    cycle_id text NOT NULL,
    host_id text NOT NULL,
    slot integer NOT NULL,
    epoch bigint NOT NULL,
    state text NOT NULL,
    write_id text NOT NULL,
    counted boolean NOT NULL DEFAULT false,
    adopted_from text,
    adopted_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pool, cycle_id),
    UNIQUE (pool, host_id, slot)
);
-- One claim per job attempt of one Forgejo: the database refuses a second.
CREATE TABLE IF NOT EXISTS ci_ephemeral_provisioner.claims (
    forgejo text NOT NULL,
    job_id bigint NOT NULL,
    handle text NOT NULL,
    pool text NOT NULL,
    cycle_id text NOT NULL,
    PRIMARY KEY (forgejo, job_id, handle),
    FOREIGN KEY (pool, cycle_id) REFERENCES ci_ephemeral_provisioner.cycles ON DELETE CASCADE
);
-- Each slot's held jobs and pickup sightings (held-jobs.json with the files store).
CREATE TABLE IF NOT EXISTS ci_ephemeral_provisioner.slots (
    pool text NOT NULL,
    host_id text NOT NULL,
    slot integer NOT NULL,
    holds text NOT NULL,
    PRIMARY KEY (pool, host_id, slot)
);
-- The pool's failure backoff (backoff.json with the files store).
CREATE TABLE IF NOT EXISTS ci_ephemeral_provisioner.backoff (
    pool text PRIMARY KEY,
    doc text NOT NULL
);
-- Adoptions and fenced runs, for `status`.
CREATE TABLE IF NOT EXISTS ci_ephemeral_provisioner.events (
    id bigserial PRIMARY KEY,
    pool text NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    kind text NOT NULL,
    host_id text NOT NULL,
    other_host text,
    cycle_id text
);
"#;

#[cfg(test)]
mod tests {
    #[test]
    fn the_script_takes_the_creation_lock_first_and_writes_its_version() {
        let first = super::CREATE
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap();
        assert!(
            first.starts_with("SELECT pg_advisory_xact_lock("),
            "{first}"
        );
        assert!(super::CREATE.contains(&format!("VALUES ({})", super::VERSION)));
    }
}
