-- Least privilege. Migrations run as the role that owns the tables; services connect as a
-- login role that is a member of z29c_service, which may read and write rows and nothing
-- else: no DDL, no ownership (so no ALTER TABLE, no DISABLE TRIGGER, no DROP), no TRUNCATE,
-- no REFERENCES or TRIGGER privilege. The append-only triggers therefore hold against a
-- compromised service too. The role is shared by every database of the server (roles are
-- cluster-wide); the grants are this database's.
-- A role that exists already (made by a superuser beforehand, or by another database's
-- migration) is used as it is, so the migrating role needs CREATEROLE only when it makes it.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'z29c_service') THEN
        CREATE ROLE z29c_service NOLOGIN;
    END IF;
EXCEPTION
    -- made by another database's migration at this very moment
    WHEN duplicate_object OR unique_violation THEN NULL;
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'the role z29c_service does not exist and % may not create it',
            current_user
            USING HINT = 'as a superuser: CREATE ROLE z29c_service NOLOGIN; then migrate again';
END
$$;

-- nobody but the owner creates objects in the schema (PostgreSQL 15's default, not that of
-- clusters upgraded from before it); a migrating role that does not own the schema leaves
-- it as it is
DO $$
BEGIN
    REVOKE CREATE ON SCHEMA public FROM PUBLIC;
EXCEPTION WHEN insufficient_privilege THEN NULL;
END
$$;

GRANT USAGE ON SCHEMA public TO z29c_service;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO z29c_service;
-- identity columns need no grant of their own; USAGE (nextval) without UPDATE, so no setval
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO z29c_service;
-- the migration history is the owner's alone
REVOKE ALL ON _sqlx_migrations FROM z29c_service;
-- tables and sequences later migrations create get the same grants, as long as the same
-- role runs them (default privileges are those of the role that creates the objects)
ALTER DEFAULT PRIVILEGES IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO z29c_service;
ALTER DEFAULT PRIVILEGES IN SCHEMA public
    GRANT USAGE ON SEQUENCES TO z29c_service;

-- the audit log refuses TRUNCATE as it refuses UPDATE and DELETE, whoever asks
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION z29c_reject_mutation();
