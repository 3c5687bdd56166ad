//! Generates the etcd v3 gRPC client from `proto/` with `protox`, a protobuf
//! compiler written in Rust, so that building rotary needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/etcdserverpb/rpc.proto", "proto/mvccpb/kv.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
