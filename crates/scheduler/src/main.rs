//! `z29c-scheduler`: this service alone (the same as `z29c scheduler`).

fn main() -> anyhow::Result<()> {
    z29c_runtime::service_main("z29c-scheduler", |c: z29c_scheduler::SchedulerConfig, t| {
        z29c_scheduler::run(c, t, None)
    })
}
