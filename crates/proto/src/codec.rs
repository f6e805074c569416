//! The protobuf codec of every z29c service: prost's, except that a message that does not
//! decode is the caller's mistake. tonic answers it with `INTERNAL` (as gRPC's status-code
//! table lists for parse errors), which tells a client to retry or page someone; z29c answers
//! `INVALID_ARGUMENT` with prost's reason (a truncated field, a wire-type mismatch, invalid
//! UTF-8 in a string field), so the caller knows to fix what it sends.

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder};

/// [`ProstCodec`] with decode failures answered as `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct Z29cCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for Z29cCodec<T, U> {
    fn default() -> Self {
        Self(ProstCodec::default())
    }
}

impl<T, U> Codec for Z29cCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as Codec>::Encoder;
    type Decoder = MalformedIsInvalid<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        MalformedIsInvalid(self.0.decoder())
    }
}

/// A decoder whose parse errors are `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct MalformedIsInvalid<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for MalformedIsInvalid<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| {
            if s.code() == tonic::Code::Internal {
                Status::invalid_argument(format!("malformed message: {}", s.message()))
            } else {
                s
            }
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
