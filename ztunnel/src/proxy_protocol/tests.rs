use super::*;

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn round_trips_ipv4_with_identity() {
    let id = b"spiffe://cluster.local/ns/default/sa/client";
    let wire = encode(
        sa("10.10.1.11:40000"),
        sa("10.10.2.11:8080"),
        &[(TLV_PEER_IDENTITY, id)],
    )
    .unwrap();
    // Signature, v2 PROXY, TCP over IPv4, 12 address bytes + 3 + the id.
    assert_eq!(&wire[..12], &SIGNATURE);
    assert_eq!(wire[12..14], [0x21, 0x11]);
    assert_eq!(
        usize::from(u16::from_be_bytes([wire[14], wire[15]])),
        12 + 3 + id.len()
    );
    let mut with_payload = wire.clone();
    with_payload.extend_from_slice(b"hello");
    let (h, n) = parse(&with_payload).unwrap();
    assert_eq!(n, wire.len());
    assert_eq!(&with_payload[n..], b"hello");
    assert_eq!(h.command, Command::Proxy);
    assert_eq!(h.transport, Transport::Stream);
    assert_eq!(
        h.addresses,
        Addresses::Ip {
            src: sa("10.10.1.11:40000"),
            dst: sa("10.10.2.11:8080")
        }
    );
    assert_eq!(
        h.peer_identity(),
        Some("spiffe://cluster.local/ns/default/sa/client")
    );
}

#[test]
fn round_trips_ipv6_and_maps_mixed_families() {
    let wire = encode(sa("[fd00::1]:1"), sa("[fd00::2]:2"), &[]).unwrap();
    assert_eq!(wire[13], 0x21);
    let (h, _) = parse(&wire).unwrap();
    assert_eq!(
        h.addresses,
        Addresses::Ip {
            src: sa("[fd00::1]:1"),
            dst: sa("[fd00::2]:2")
        }
    );
    assert_eq!(h.peer_identity(), None);
    assert!(matches!(
        encode(sa("10.0.0.1:1"), sa("[fd00::2]:2"), &[]),
        Err(ProxyProtocolError::MixedFamilies { .. })
    ));
    let (s, d) = same_family(sa("10.0.0.1:1"), sa("[fd00::2]:2"));
    assert_eq!(s, sa("[::ffff:10.0.0.1]:1"));
    assert_eq!(d, sa("[fd00::2]:2"));
    assert!(encode(s, d, &[]).is_ok());
}

#[test]
fn too_long_tlvs_are_refused() {
    let big = vec![0u8; 65535];
    assert!(matches!(
        encode(sa("10.0.0.1:1"), sa("10.0.0.2:2"), &[(0xD0, &big)]),
        Err(ProxyProtocolError::TooLong(_))
    ));
}

#[test]
fn incomplete_input_says_how_much_is_needed() {
    let wire = encode(sa("10.0.0.1:1"), sa("10.0.0.2:2"), &[(0xD0, b"x")]).unwrap();
    for cut in 0..wire.len() {
        match parse(&wire[..cut]) {
            Err(ProxyProtocolError::Incomplete { needed, have }) => {
                assert_eq!(have, cut);
                assert_eq!(
                    needed,
                    if cut < FIXED_LEN {
                        FIXED_LEN
                    } else {
                        wire.len()
                    }
                );
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
}

#[test]
fn strict_about_every_field() {
    let good = encode(sa("10.0.0.1:1"), sa("10.0.0.2:2"), &[(0xD0, b"id")]).unwrap();
    let with = |i: usize, b: u8| {
        let mut w = good.clone();
        w[i] = b;
        parse(&w)
    };
    assert_eq!(
        parse(b"GET / HTTP/1.1\r\n"),
        Err(ProxyProtocolError::BadSignature)
    );
    assert_eq!(
        parse(b"PROXY TCP4 1.2.3.4"),
        Err(ProxyProtocolError::BadSignature)
    );
    assert_eq!(with(12, 0x11), Err(ProxyProtocolError::BadVersion(1)));
    assert_eq!(with(12, 0x22), Err(ProxyProtocolError::BadCommand(2)));
    assert_eq!(with(13, 0x41), Err(ProxyProtocolError::BadFamily(4)));
    assert_eq!(with(13, 0x13), Err(ProxyProtocolError::BadTransport(3)));
    // Length shorter than the IPv4 address block.
    let mut short = good[..FIXED_LEN].to_vec();
    short[14..16].copy_from_slice(&4u16.to_be_bytes());
    short.extend_from_slice(&[0; 4]);
    assert_eq!(
        parse(&short),
        Err(ProxyProtocolError::ShortAddresses {
            length: 4,
            needed: 12
        })
    );
    // A TLV claiming more than the header holds.
    let mut lying = good.clone();
    let tlv_len_at = FIXED_LEN + 12 + 1;
    lying[tlv_len_at..tlv_len_at + 2].copy_from_slice(&9u16.to_be_bytes());
    assert!(matches!(
        parse(&lying),
        Err(ProxyProtocolError::TruncatedTlv {
            claimed: 9,
            left: 2,
            ..
        })
    ));
    // Stray bytes after the address block that are not a whole TLV header.
    let mut stray = good[..FIXED_LEN + 12].to_vec();
    stray[14..16].copy_from_slice(&14u16.to_be_bytes());
    stray.extend_from_slice(&[0xD0, 0]);
    assert!(matches!(
        parse(&stray),
        Err(ProxyProtocolError::TruncatedTlv {
            claimed: 3,
            left: 2,
            ..
        })
    ));
}

#[test]
fn local_unspec_and_unix_headers_parse() {
    let mut local = SIGNATURE.to_vec();
    local.extend_from_slice(&[0x20, 0x00, 0, 0]);
    let (h, n) = parse(&local).unwrap();
    assert_eq!(
        (h.command, h.transport, h.addresses, n),
        (Command::Local, Transport::Unspec, Addresses::Unspec, 16)
    );
    let mut unix = SIGNATURE.to_vec();
    unix.extend_from_slice(&[0x21, 0x31]);
    unix.extend_from_slice(&216u16.to_be_bytes());
    unix.extend_from_slice(&[b'a'; 216]);
    let (h, _) = parse(&unix).unwrap();
    assert!(
        matches!(h.addresses, Addresses::Unix { ref src, ref dst } if src.len() == 108 && dst.len() == 108)
    );
}

#[tokio::test]
async fn reads_exactly_one_header_from_a_stream() {
    let mut wire = encode(
        sa("10.0.0.1:1"),
        sa("10.0.0.2:2"),
        &[(0xD0, b"spiffe://td/ns/a/sa/b")],
    )
    .unwrap();
    wire.extend_from_slice(b"payload");
    let mut r = &wire[..];
    let h = read_header(&mut r).await.unwrap();
    assert_eq!(h.peer_identity(), Some("spiffe://td/ns/a/sa/b"));
    assert_eq!(r, b"payload");
    let mut short = &wire[..20];
    assert!(matches!(
        read_header(&mut short).await,
        Err(ProxyProtocolError::Io(_))
    ));
}
