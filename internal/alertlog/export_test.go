package alertlog

// SelectRecent is Recent's query, for its plan test.
const SelectRecent = selectRecent
