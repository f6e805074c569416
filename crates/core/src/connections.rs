//! Whether a service's pool fits the PostgreSQL server it connects to.
//!
//! Every service keeps a pool, and a deployment's pools together may ask for more sessions
//! than the server allows. Nothing is lost then (a call waits for a connection, and one that
//! waits too long fails and is retried), but everything slows, so a service says so at start,
//! naming the numbers, rather than leaving the operator to find out under load.

/// The server's side: its `max_connections`, the part kept for superusers
/// (`superuser_reserved_connections`), and the sessions open now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConnections {
    pub max_connections: u32,
    pub reserved: u32,
    pub in_use: u32,
}

impl ServerConnections {
    /// Sessions still free for ordinary roles.
    pub const fn free(&self) -> u32 {
        self.max_connections
            .saturating_sub(self.reserved)
            .saturating_sub(self.in_use)
    }
}

/// A warning when a pool of `pool` connections may want more sessions than `server` has free
/// now, in words for the operator; none when it fits.
pub fn pool_warning(pool: u32, server: &ServerConnections) -> Option<String> {
    let free = server.free();
    (pool > free).then(|| {
        format!(
            "this service's pool may open {pool} connections but PostgreSQL has {free} free \
             (max_connections {}, {} reserved for superusers, {} in use): calls will wait for a \
             connection and work will slow down, though nothing is lost; lower the services' \
             max_connections or raise the server's",
            server.max_connections, server.reserved, server.in_use
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(max_connections: u32, reserved: u32, in_use: u32) -> ServerConnections {
        ServerConnections {
            max_connections,
            reserved,
            in_use,
        }
    }

    #[test]
    fn a_pool_that_fits_is_not_warned_about() {
        assert_eq!(pool_warning(10, &server(100, 3, 20)), None);
        // exactly what is free fits
        assert_eq!(pool_warning(77, &server(100, 3, 20)), None);
    }

    #[test]
    fn a_pool_larger_than_what_is_free_is_warned_about_with_the_numbers() {
        let w = pool_warning(78, &server(100, 3, 20)).unwrap();
        for part in [
            "78 connections",
            "77 free",
            "max_connections 100",
            "3 reserved",
            "20 in use",
        ] {
            assert!(w.contains(part), "{part}: {w}");
        }
    }

    #[test]
    fn a_full_or_odd_server_counts_nothing_free() {
        assert_eq!(server(10, 3, 20).free(), 0);
        assert_eq!(server(2, 3, 0).free(), 0);
        assert!(pool_warning(1, &server(10, 3, 7)).is_some());
        assert!(pool_warning(0, &server(10, 3, 7)).is_none());
    }
}
