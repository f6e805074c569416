//! `z29c-recovery`: this service alone (the same as `z29c recovery`).

fn main() -> anyhow::Result<()> {
    z29c_runtime::service_main("z29c-recovery", |c: z29c_recovery::RecoveryConfig, t| {
        z29c_recovery::run(c, t, None)
    })
}
