"""An MCP server over stdio with one tool, ``add``: what an agent's MCP calculator (as in Agent Lightning's calc_x)
talks to. ``python mcp_calculator.py`` serves until its stdin closes."""

from mcp.server.fastmcp import FastMCP

server = FastMCP("calculator")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


if __name__ == "__main__":
    server.run()
