//! When z29c vacuums its own tables.
//!
//! Every claim, renewal and receipt leaves dead row versions behind. Removing them is
//! autovacuum's job, and the migrations set the thresholds the hot tables need. A server may
//! run with `autovacuum = off`, though, and per-table settings cannot turn it back on. The
//! dead rows then pile up, and every claim and fence walks past them: on such a server a
//! 20-minute steady run lost a third of its throughput.
//!
//! So the scheduler vacuums the tables that no autovacuum will visit. It applies autovacuum's
//! own rule (PostgreSQL's `relation_needs_vacanalyze`) with the table's own settings. Where
//! autovacuum runs, z29c leaves the table to it.

/// One table's dead rows and the autovacuum settings that apply to it, as PostgreSQL's
/// statistics and the table's options give them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableHealth {
    /// Dead row versions (`n_dead_tup`).
    pub dead: i64,
    /// Live rows (`n_live_tup`).
    pub live: i64,
    /// `autovacuum_vacuum_threshold`: the table's own, or the server's.
    pub threshold: i64,
    /// `autovacuum_vacuum_scale_factor`: the table's own, or the server's.
    pub scale: f64,
    /// Whether autovacuum will visit the table: the server's `autovacuum` and `track_counts`
    /// are on, and the table's `autovacuum_enabled` is not off.
    pub autovacuum: bool,
}

impl TableHealth {
    /// Whether z29c should vacuum the table now: no autovacuum will, and its dead rows are past
    /// `threshold + scale × live`, the point where autovacuum would have.
    pub fn needs_our_vacuum(&self) -> bool {
        let past = self.threshold.max(0) as f64 + self.scale.max(0.0) * self.live.max(0) as f64;
        !self.autovacuum && self.dead > 0 && self.dead as f64 > past
    }
}

#[cfg(test)]
mod tests {
    use super::TableHealth;

    fn table(dead: i64, live: i64, threshold: i64, scale: f64, autovacuum: bool) -> TableHealth {
        TableHealth {
            dead,
            live,
            threshold,
            scale,
            autovacuum,
        }
    }

    #[test]
    fn a_table_autovacuum_visits_is_left_to_it_however_many_rows_are_dead() {
        for dead in [0, 1, 51, 10_000, i64::MAX] {
            for live in [0, 1_000, 1_000_000] {
                assert!(!table(dead, live, 50, 0.02, true).needs_our_vacuum());
            }
        }
    }

    #[test]
    fn without_autovacuum_the_table_is_vacuumed_past_autovacuums_own_point() {
        // 50 + 0.02 × 10,000 = 250
        assert!(!table(249, 10_000, 50, 0.02, false).needs_our_vacuum());
        assert!(!table(250, 10_000, 50, 0.02, false).needs_our_vacuum());
        assert!(table(251, 10_000, 50, 0.02, false).needs_our_vacuum());
        // an empty table: the threshold alone
        assert!(!table(50, 0, 50, 0.2, false).needs_our_vacuum());
        assert!(table(51, 0, 50, 0.2, false).needs_our_vacuum());
    }

    #[test]
    fn the_tables_own_scale_factor_decides_for_a_large_table() {
        // the migrations give the hot tables 0.02 where the server's default is 0.2
        let (dead, live) = (30_000, 1_000_000);
        assert!(table(dead, live, 50, 0.02, false).needs_our_vacuum());
        assert!(!table(dead, live, 50, 0.2, false).needs_our_vacuum());
    }

    #[test]
    fn no_dead_rows_means_no_vacuum_even_at_a_zero_threshold() {
        assert!(!table(0, 0, 0, 0.0, false).needs_our_vacuum());
        assert!(!table(0, 5_000, 0, 0.0, false).needs_our_vacuum());
        assert!(table(1, 5_000, 0, 0.0, false).needs_our_vacuum());
    }

    #[test]
    fn counts_the_statistics_got_wrong_are_read_as_none() {
        // statistics are estimates: a negative count or setting counts as zero, not as a debt
        assert!(!table(-5, 100, 50, 0.02, false).needs_our_vacuum());
        assert!(table(60, -100, 50, 0.02, false).needs_our_vacuum());
        assert!(table(60, 100, -50, -1.0, false).needs_our_vacuum());
        assert!(!table(60, 100, 50, 0.2, false).needs_our_vacuum());
    }
}
