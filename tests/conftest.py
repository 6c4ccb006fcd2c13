from tests.servers import *  # noqa: F403 - shared server fixtures
