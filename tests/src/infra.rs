//! Servers a scenario owns alone, so it may kill and restart them without touching the
//! machine's shared PostgreSQL and NATS: `z29c_throwaway`'s, shared with `z29c dev`.

pub use z29c_throwaway::{DURABLE_SETTINGS, PrivateNats, PrivatePostgres};
