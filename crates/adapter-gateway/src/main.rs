//! `z29c-adapter-gateway`: this service alone (the same as `z29c gateway`).

fn main() -> anyhow::Result<()> {
    z29c_runtime::service_main(
        "z29c-adapter-gateway",
        |c: z29c_adapter_gateway::GatewayConfig, t| z29c_adapter_gateway::run(c, t, None),
    )
}
