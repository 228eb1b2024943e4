//! A raw HTTP/2 client, for what a correct client never sends: streams
//! that announce a message and never finish it, resets, endless header
//! blocks.

#[allow(unused_imports)]
use super::*;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

/// What an HTTP/2 client sends first: the connection preface and an empty
/// SETTINGS frame.
pub const H2_START: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// An HPACK block of a gRPC request to `path` (literal headers, never
/// indexed: no dynamic table state).
pub fn grpc_headers(path: &str) -> Vec<u8> {
    let mut block = vec![0x83, 0x86];
    for (name, value) in
        [(":path", path), (":authority", "t"), ("content-type", "application/grpc"), ("te", "trailers")]
    {
        block.push(0x00);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

/// One HTTP/2 frame.
pub fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut frame = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// A connection to `addr` from the loopback address `from` (any of
/// 127.0.0.0/8: another peer to the server), the preface sent and the
/// server's SETTINGS acknowledged, the server's frames read until its
/// connection window update (so DATA may follow at once).
pub async fn h2_connect(addr: SocketAddr, from: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut socket = socket.connect(addr).await.unwrap();
    socket.write_all(H2_START).await.unwrap();
    socket.write_all(&h2_frame(4, 0x1, 0, &[])).await.unwrap(); // SETTINGS ACK
    loop {
        let mut head = [0u8; 9];
        socket.read_exact(&mut head).await.unwrap();
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        socket.read_exact(&mut vec![0; len]).await.unwrap();
        if head[3] == 8 {
            return socket;
        }
    }
}

/// Reads and drops whatever the server sends on `socket` until it closes,
/// so the server's writes never block.
pub fn h2_drain(mut socket: TcpStream) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut sink = vec![0; 64 * 1024];
        while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
    })
}
