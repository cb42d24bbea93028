-- include: lib/budget.lua
--[[
budget_settle.lua - settles one hold (lib/budget.lua): each budget's amount held moves to
its period's spent total as the actual usage, in the period that admitted the hold (its
key is named by that period's start, whatever the time now). The build (setup.py)
prepends the file named above and embeds the whole in the C extension: the only copy.

KEYS[i]    budget i's key of the admitting period (i = 1..n)
ARGV[1]    the hold's id
ARGV[2 + 3(i-1) ..]  budget i's actual usage, an integer >= 0 (0 releases the hold unused;
           more than the amount held is charged, never refused), its limit and its soft
           limits packed (as budget_hold.lua's)
ARGV[last] optional replay marker ("1", proto.c): settling twice changes nothing; a
           crossing this settle fired is reported again (its first reply was lost)

Returns the number of budgets whose hold was found (0 once settled, or expired); when the
settle crossed a soft limit of some budget (or is the replay of one that did), {found,
{threshold fired before per budget}, {threshold fired now per budget}}.
--]]

return budget_settle(#KEYS, ARGV[1], 2, #ARGV > 1 + 3 * #KEYS)
