//! `z29c-executor`: this service alone (the same as `z29c executor`).

fn main() -> anyhow::Result<()> {
    z29c_runtime::service_main("z29c-executor", |c: z29c_executor::ExecutorConfig, t| {
        z29c_executor::run(c, t)
    })
}
