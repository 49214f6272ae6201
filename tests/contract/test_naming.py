import pytest

from gpuaas_agent.contract.naming import allocation_from_domain_name, domain_name, vnic_name

ALLOC = "3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b"


def test_domain_name_round_trips_to_the_allocation():
    name = domain_name(ALLOC)
    assert name == "gpuaas-slice-3f2b8c1e9a4d4e6f8b7a1c2d3e4f5a6b"
    assert allocation_from_domain_name(name) == ALLOC


@pytest.mark.parametrize("name", ["gpuaas-slice-xyz", "other-3f2b8c1e9a4d4e6f8b7a1c2d3e4f5a6b", "gpuaas-slice-"])
def test_foreign_domain_names_are_not_ours(name):
    assert allocation_from_domain_name(name) is None


def test_vnic_names_fit_linux_and_avoid_libvirt_prefix():
    names = {vnic_name(ALLOC, i) for i in range(256)}
    assert len(names) == 256
    assert all(len(n) <= 15 and not n.startswith("vnet") for n in names)
    assert vnic_name(ALLOC, 7) == "gs7-3f2b8c1e9a"


@pytest.mark.parametrize("bad", ["3F2B8C1E-9A4D-4E6F-8B7A-1C2D3E4F5A6B", "not-a-uuid", ""])
def test_non_uuid_allocations_are_refused(bad):
    with pytest.raises(ValueError):
        domain_name(bad)


def test_slot_index_out_of_range_is_refused():
    with pytest.raises(ValueError):
        vnic_name(ALLOC, 256)
